"""Let `cp=2` select the config group option `cp/2.yaml`, and refuse a group option that does not
exist (or a launcher whose plugin is not installed) before Hydra does (Hydra's own error exits 1
and lists nothing to do instead).

Hydra parses `cp=2` as an integer and refuses it as a group choice ("Config group override must be
a string"). Quoting the value on the way in keeps the documented command line (`cp=2`,
`-m cp=1,2,4`) working; everything else is passed through untouched.
"""

from __future__ import annotations

import re
from pathlib import Path

from recipe.environment import read_environment

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
    with another job). Ranks other than 0 therefore write no Hydra files or logs; they keep a
    `hydra.run.dir` given on the command line (where checkpoints gather every rank's shard) and
    otherwise run in the current directory. Rank 0's directory is the job's one output directory.
    """
    if read_environment(environ).rank == 0:
        return args
    if any(arg.startswith("hydra.run.dir=") for arg in args):
        # The job's directory, named on every rank's command line (train.sbatch, the README's
        # torchrun): every rank must write its checkpoint shards there, rank 0 alone the rest.
        return [*args, *QUIET_HYDRA_OUTPUTS]
    return [*args, "hydra.run.dir=.", *QUIET_HYDRA_OUTPUTS]


# What a rank other than 0 adds so that it writes no Hydra files or logs (its warnings and errors
# still reach its own stderr, which the launcher keeps per rank).
QUIET_HYDRA_OUTPUTS = (
    "hydra.output_subdir=null",
    "hydra/job_logging=disabled",
    "hydra/hydra_logging=disabled",
)

# The launchers that need hydra-submitit-launcher: the recipe's own (conf/hydra/launcher/) and
# the plugin's.
SUBMITIT_LAUNCHERS = ("slurm", "local_tasks", "submitit_slurm", "submitit_local")


def check_launcher_plugin(args: list[str], plugin_installed: bool) -> str | None:
    """A message when a submitit launcher is asked for without the plugin, else None. Hydra's own
    error for it names a missing config and lists the launchers it knows, not the install."""
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") == "hydra/launcher" and value in SUBMITIT_LAUNCHERS:
            if not plugin_installed:
                return (
                    f"hydra/launcher={value} needs hydra-submitit-launcher, which is not "
                    'installed: pip install -e ".[slurm]"'
                )
    return None


# What to use when a group has no file for the option asked for.
OPTION_HINTS = {"cp": "cp.size={value} sets any context-parallel size (with cp=1 as the base)"}


def check_group_choices(args: list[str], conf_dir: Path) -> str | None:
    """A message for the first `group=option` naming an option the group does not have, else
    None. Only plain choices are checked (sweeps `a,b`, quoted numbers); Hydra handles the rest."""
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+")
        if not sep or key.startswith("~") or "." in group or group.startswith("hydra/"):
            continue  # hydra/* groups also have Hydra's built-in options, which have no file here
        if not (conf_dir / group).is_dir():
            continue
        if any(c in value for c in "()[]{}$"):  # sweep functions, interpolations: Hydra's part
            continue
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        for choice in (c.strip().strip("'\"") for c in value.split(",")):
            if choice and choice != "null" and choice not in options:
                hint = OPTION_HINTS.get(group, "").format(value=choice)
                return (
                    f"{group}={choice}: the config group {group} has no option {choice!r}; "
                    f"its options are {', '.join(options)}" + (f"; {hint}" if hint else "")
                )
    return None
