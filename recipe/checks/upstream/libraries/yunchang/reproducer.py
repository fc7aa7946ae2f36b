"""A finding's standalone reproducer: the prelude, then truth.py's and ranks.py's parts and
`wheel_outputs` below, shipped verbatim by `inspect.getsource` (so they are linted and scanned
like the rest), then the case's constants and two lines of glue.
"""

from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.checks.upstream.libraries.yunchang.ranks import (
    DistOfRank,
    Group,
    GroupMaker,
    StandInMissing,
    run_ranks,
)
from recipe.checks.upstream.libraries.yunchang.truth import (
    describe_case,
    group_ranks,
    layout_problems,
    layout_unit,
    make_value,
    name_id,
    problem_texts,
    ring_positions,
    shard_positions,
    truth_outputs,
    value_shape,
)
from recipe.upstream.prelude import load_from_wheel


def wheel_outputs(wheel, globals_file, extract_file, function_name, case, options):
    """Every rank's output of the release in `wheel`: its globals.py loaded by path, then
    extract_local.py with `yunchang.globals` a module holding only the release's PROCESS_GROUP."""
    groups = load_from_wheel(wheel, globals_file, {})
    module = load_from_wheel(
        wheel, extract_file, {"yunchang.globals": {"PROCESS_GROUP": groups.PROCESS_GROUP}}
    )
    return run_ranks(module, groups, function_name, case, options)


SCRIPT_PARTS = (
    StandInMissing,
    Group,
    GroupMaker,
    DistOfRank,
    layout_unit,
    ring_positions,
    group_ranks,
    shard_positions,
    value_shape,
    make_value,
    truth_outputs,
    run_ranks,
    describe_case,
    name_id,
    layout_problems,
    problem_texts,
    wheel_outputs,
)

# The script's own imports (the prelude imports neither).
SCRIPT_IMPORTS = ("math", "torch")

# The glue: the entry points a reproducer defines, calling the shipped parts on its constants.
ENTRY = entry_points(
    "wheel_outputs(wheel, GLOBALS_FILE, EXTRACT_FILE, FUNCTION, CASE, OPTIONS)",
    "problem_texts(LAYOUT, CASE, OPTIONS, outputs)",
)


def script(layout: str, function: str, globals_file: str, extract_file: str) -> str:
    """The body of a reproducer of `function` (laying out `layout`): the imports, the shipped
    parts' sources, the constants the glue reads and the glue."""
    constants = {
        "LAYOUT": layout,
        "FUNCTION": function,
        "GLOBALS_FILE": globals_file,
        "EXTRACT_FILE": extract_file,
    }
    return script_body(SCRIPT_PARTS, constants, imports=SCRIPT_IMPORTS, entry=ENTRY)
