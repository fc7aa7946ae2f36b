"""A finding's standalone reproducer: the prelude, then the shipped parts of a truth module
(`PACKER_SHIPPED`, `MTP_SHIPPED`) and the two functions below, verbatim by `inspect.getsource` (so
they are linted and scanned like the rest), the truth's constants and the release's file and
function by value, and two lines of glue.
"""

import importlib.machinery
import importlib.util
import inspect
import sys
from pathlib import Path

from recipe.checks.upstream.kit.checked import entry_points
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
from recipe.upstream.prelude import extract, scratch_folder


def load_release(wheel, relative):
    """The released file at `relative`, from the wheel, executed as a module registered in
    sys.modules while it runs (as targets.load_registered does); the released files need no
    stubs."""
    folder = scratch_folder("repro-src-")
    extract(wheel, relative, folder)  # a wheel, an sdist or an installed folder
    name = "released_" + Path(relative).stem
    loader = importlib.machinery.SourceFileLoader(name, str(folder / relative))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    sys.modules[name] = module
    loader.exec_module(module)
    return module


def named_problems(found):
    """What a reproducer reports: every (impact, what), the worst first, named by its impact."""
    found = sorted(found, key=lambda p: -p[0])
    names = {1: "padding only", 2: "raises", 3: "real tokens misplaced", 4: "real tokens lost"}
    return [f"[{names[impact]}] {what}" for impact, what in found]


# The script's own imports (the prelude's are the rest, and its scratch_folder).
SCRIPT_IMPORTS = "import math\n"


def script(shipped: tuple, constants: dict, relative: str, function: str, call, check) -> str:
    """The body of a reproducer of `function` in the released file `relative`: the imports, the
    sources of `shipped` and of this module's two functions, `constants`, the release's file and
    function, and the glue running the release with `call` and judging it with `check` (both
    in `shipped`)."""
    parts = (*shipped, load_release, named_problems)
    sources = "\n\n\n".join(inspect.getsource(part).strip() for part in parts)
    constants = {**constants, "RELATIVE": relative, "FUNCTION": function}
    values = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    # the glue: the entry points, `call` running the release and `check` judging it
    entry = entry_points(
        f"{call.__name__}(load_release(wheel, RELATIVE), FUNCTION, CASE, OPTIONS)",
        f"named_problems({check.__name__}(CASE, OPTIONS, outputs))",
    ).strip()
    return f"{SCRIPT_IMPORTS}\n\n{sources}\n\n\n{values}\n\n{entry}\n"


def packer_script(relative: str, function: str) -> str:
    """The body of a reproducer of the packer: packer_truth.py's parts."""
    return script(PACKER_SHIPPED, PACKER_CONSTANTS, relative, function, call_packer, pack_problems)


def mtp_script(relative: str, function: str) -> str:
    """The body of a reproducer of the MTP shift: mtp_truth.py's parts."""
    return script(MTP_SHIPPED, MTP_CONSTANTS, relative, function, call_mtp, mtp_problems)
