"""A finding's standalone reproducer: the prelude (whose `load_from_wheel` loads the release's
file, as the checker's `source.load_module` does), then the truth's constants and the release's
file and function by value, the shipped parts of a truth module (`PACKER_SHIPPED`,
`MTP_SHIPPED`) and `named_problems` below, verbatim by `inspect.getsource` (so they are linted and
scanned like the rest), and the entry points.
"""

from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.checks.upstream.libraries.nemo_automodel.mtp_truth import (
    MTP_CONSTANTS,
    MTP_SHIPPED,
    call_mtp,
    mtp_problems,
)
from recipe.checks.upstream.libraries.nemo_automodel.packer_truth import (
    PACKER_CONSTANTS,
    PACKER_SHIPPED,
    call_packer,
    pack_problems,
)


def named_problems(found):
    """What a reproducer reports: every (impact, what), the worst first, named by its impact."""
    found = sorted(found, key=lambda p: -p[0])
    names = {1: "padding only", 2: "raises", 3: "real tokens misplaced", 4: "real tokens lost"}
    return [f"[{names[impact]}] {what}" for impact, what in found]


# The script's own imports (the prelude's are the rest, and its scratch_folder).
SCRIPT_IMPORTS = ("math",)


def script(shipped: tuple, constants: dict, relative: str, function: str, call, check) -> str:
    """The body of a reproducer of `function` in the released file `relative`: the imports, the
    sources of `shipped` and of this module's two functions, `constants`, the release's file and
    function, and the glue running the release with `call` and judging it with `check` (both
    in `shipped`)."""
    entry = entry_points(
        f"{call.__name__}(load_from_wheel(wheel, RELATIVE, {{}}), FUNCTION, CASE, OPTIONS)",
        f"named_problems({check.__name__}(CASE, OPTIONS, outputs))",
    )
    return script_body(
        (*shipped, named_problems),
        {**constants, "RELATIVE": relative, "FUNCTION": function},
        imports=SCRIPT_IMPORTS,
        entry=entry,
    )


def packer_script(relative: str, function: str) -> str:
    """The body of a reproducer of the packer: packer_truth.py's parts."""
    return script(PACKER_SHIPPED, PACKER_CONSTANTS, relative, function, call_packer, pack_problems)


def mtp_script(relative: str, function: str) -> str:
    """The body of a reproducer of the MTP shift: mtp_truth.py's parts."""
    return script(MTP_SHIPPED, MTP_CONSTANTS, relative, function, call_mtp, mtp_problems)
