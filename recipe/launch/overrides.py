"""Let `cp=2` select the config group option `cp/2.yaml`.

Hydra parses `cp=2` as an integer and refuses it as a group choice ("Config group override must be
a string"). Quoting the value on the way in keeps the documented command line (`cp=2`,
`-m cp=1,2,4`) working; everything else is passed through untouched.
"""

from __future__ import annotations

import re

from recipe.launch.environment import read_environment

NUMERIC_GROUPS = ("cp",)
_NUMBER_LIST = re.compile(r"^\d+(,\d+)*$")


def quote_numeric_group_choices(
    args: list[str], groups: tuple[str, ...] = NUMERIC_GROUPS
) -> list[str]:
    """Rewrite `cp=2` to `cp='2'` and `cp=1,2,4` to `cp='1','2','4'` for the given groups."""
    rewritten = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in groups and _NUMBER_LIST.match(value):
            value = ",".join(f"'{choice}'" for choice in value.split(","))
            arg = f"{key}={value}"
        rewritten.append(arg)
    return rewritten


def single_run_dir_for_rank(args: list[str], environ: dict[str, str]) -> list[str]:
    """Under torchrun or SLURM every rank runs Hydra; only rank 0 may create a run directory.

    Each rank would otherwise make its own timestamped folder (or, in the same second, share one
    with another job). Ranks other than 0 therefore run in the current directory and write no
    Hydra files or logs; rank 0's directory is the job's one output directory.
    """
    if read_environment(environ).rank == 0:
        return args
    return [
        *args,
        "hydra.run.dir=.",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
