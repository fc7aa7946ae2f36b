"""Let `cp=2` select the config group option `cp/2.yaml`, and refuse a group option that does not
exist, a key the schema does not define, or a launcher whose plugin is not installed before Hydra
does (Hydra's own error exits 1 and points at the wrong fix, or at none).

Hydra parses `cp=2` as an integer and refuses it as a group choice ("Config group override must be
a string"). Quoting the value on the way in keeps the documented command line (`cp=2`,
`-m cp=1,2,4`) working; everything else is passed through untouched.
"""

from __future__ import annotations

import re
from pathlib import Path

from recipe.config.keys import unknown_key
from recipe.environment import launched_run_name, read_environment
from recipe.errors import ConfigError

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


def run_dir_for_launched_rank(args: list[str], environ: dict[str, str]) -> list[str]:
    """Under torchrun, SLURM or submitit every rank runs Hydra: they must all name one run
    directory, and only rank 0 may create it (Hydra's files, the log, the claim).

    Each rank would otherwise resolve the default `outputs/<date>/<time>` at its own microsecond,
    and rank 1's checkpoint shards would land elsewhere than the manifest rank 0 writes. Without a
    `hydra.run.dir` on the command line the ranks take `outputs/<launcher>/<id>` from what their
    launcher tells every rank alike (torchrun's run id, SLURM's job and step); ranks other than 0
    also write no Hydra files or logs. Raises ConfigError for a launcher that names nothing.
    A multirun's directories are decided by the process that submits it: unchanged.
    """
    env = read_environment(environ)
    if not env.external or any(a in ("-m", "--multirun") for a in args):
        return args
    if not any(arg.startswith("hydra.run.dir=") for arg in args):
        name = launched_run_name(environ)
        if name is None:
            raise ConfigError(
                f"rank {env.rank} of {env.world_size}: the launcher gives the ranks no shared "
                "run id to name their one run directory by; pass the same hydra.run.dir=DIR to "
                "every rank"
            )
        args = [*args, f"hydra.run.dir=outputs/{name}"]
    return args if env.rank == 0 else [*args, *QUIET_HYDRA_OUTPUTS]


# What a rank other than 0 adds so that it writes no Hydra files or logs: its warnings and errors
# reach its own stderr, naming the rank (conf/hydra/job_logging/other_ranks.yaml).
QUIET_HYDRA_OUTPUTS = (
    "hydra.output_subdir=null",
    "hydra/job_logging=other_ranks",
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
        bare = value.strip().strip("'\"")
        if bare in ("", "null"):  # Hydra: a traceback (null, even where the default is null)
            return (
                f"{group}={value}: a config group takes one of its options "
                f"({', '.join(options)}); leave {group} out for its default"
            )
        for choice in (c.strip().strip("'\"") for c in value.split(",")):
            if choice and choice != "null" and choice not in options:
                hint = OPTION_HINTS.get(group, "").format(value=choice)
                return (
                    f"{group}={choice}: the config group {group} has no option {choice!r}; "
                    f"its options are {', '.join(options)}" + (f"; {hint}" if hint else "")
                )
    return None


def check_override_keys(args: list[str], conf_dir: Path) -> str | None:
    """A message for the first override whose key the schema does not define, else None.

    Hydra answers `trainer.max_step=5` with advice to add the key with `+`, which the schema then
    refuses at start-up; named here, the typo gets the closest key instead. Hydra's own keys
    (`hydra.run.dirr`) are checked against Hydra's own schema. `hydra/launcher=...`, group
    choices (`cp=2`, `experiment=...`), deletions (`~key`) and Hydra's flags are left to Hydra;
    `+`/`++` keys are checked like plain ones (a real key with `+` still gets Hydra's own advice
    to drop it)."""
    for arg in args:
        key, sep, _ = arg.partition("=")
        key = key.lstrip("+")
        if not sep or arg.startswith(("-", "~")) or "@" in key or "/" in key:
            continue
        if key == "hydra":
            continue
        if key.startswith("hydra."):  # Hydra's own schema: its answer to a typo is to add it
            from hydra.conf import HydraConf

            if problem := unknown_key(key.removeprefix("hydra."), HydraConf, root="hydra."):
                return problem
            continue
        if "." not in key and (conf_dir / key).is_dir():
            continue  # a group choice; check_group_choices checks the option
        if problem := unknown_key(key):
            return problem
    return None


# Where Hydra puts a job's files when no override says: the fixed part of conf/train.yaml's
# hydra.run.dir and hydra.sweep.dir.
DEFAULT_OUTPUT_ROOTS = {"run": "outputs", "sweep": "multirun"}


def check_output_directory(args: list[str], cwd: Path, writable=None) -> str | None:
    """A message when the job's run (or sweep) directory cannot be made: its nearest existing
    folder is a file, or cannot be written (a read-only file system, no permission). Hydra
    would answer with its logging set-up's traceback; nothing has been written yet here.
    `writable(path)` defaults to os.access for writing."""
    import os

    writable = writable or (lambda path: os.access(path, os.W_OK | os.X_OK))
    multirun = any(arg in ("-m", "--multirun") for arg in args)
    which = "sweep" if multirun else "run"
    key = f"hydra.{which}.dir"
    given = [arg.partition("=")[2] for arg in args if arg.lstrip("+").startswith(f"{key}=")]
    if not given and any(arg.startswith(("experiment=", "hydra.mode=")) for arg in args):
        return None  # a config of the user's may set the directory: Hydra's part
    value = given[-1] if given else DEFAULT_OUTPUT_ROOTS[which]
    fixed = value.split("${", 1)[0]  # the part no interpolation decides
    if not fixed:
        return None
    path = Path(fixed) if Path(fixed).is_absolute() else cwd / fixed
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    named = f"{key}={value}" if given else f"{key} (default {value}/..., under {cwd})"
    if not existing.is_dir():
        return f"{named}: {existing} is a file, not a folder; give a {which} directory elsewhere"
    if not writable(existing):
        return (
            f"{named}: {existing} cannot be written (a read-only file system, or no permission); "
            f"give a {which} directory you can write, e.g. {key}=$HOME/runs/NAME"
        )
    return None
