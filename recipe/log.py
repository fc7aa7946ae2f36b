"""Console and log-file output: one logger per module that speaks on rank 0 only.

Hydra configures Python logging for every job (`conf/hydra/job_logging/recipe.yaml`): messages
go to the console as plain text (information to stdout, errors to stderr) and, with timestamps,
to `<run dir>/train.log`, so the log file holds what the console showed. At a world size above
one rank 0 logs just so, whoever started it: under torchrun, SLURM or submitit every rank runs the
Hydra app, and a rank the recipe spawns itself (a fresh interpreter Hydra never ran in) applies
its job's logging set-up, handed over as `JobLogging`. Ranks other than 0 write no train.log:
their warnings and errors go to their own stderr, each naming the rank (`RankWarnings`), and
`get_logger` drops their information, which would repeat rank 0's.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from dataclasses import dataclass


class RankZeroLogger(logging.LoggerAdapter):
    """A logger whose info/debug messages are kept on rank 0 only (rank_zero_only=False keeps
    them everywhere); warnings and errors come from every rank."""

    def log(self, level, msg, *args, rank_zero_only: bool | None = None, **kwargs):
        if rank_zero_only is None:
            rank_zero_only = level < logging.WARNING
        if rank_zero_only and _rank() != 0:
            return
        self.logger.log(level, msg, *args, **kwargs)


def _rank() -> int:
    from recipe.environment import read_environment

    return read_environment(os.environ).rank


def get_logger(name: str) -> RankZeroLogger:
    return RankZeroLogger(logging.getLogger(name), {})


class RankWarnings(logging.StreamHandler):
    """Where a rank other than 0 logs: warnings and errors on its stderr, naming the rank. Used
    by `conf/hydra/job_logging/other_ranks.yaml` and by the ranks the recipe spawns."""

    def __init__(self):
        super().__init__(sys.stderr)
        self.setLevel(logging.WARNING)
        self.rank = _rank()

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        # The Hydra task's errors already begin `rank N on HOST: `; naming it twice reads badly.
        return text if text.startswith(f"rank {self.rank} ") else f"rank {self.rank}: {text}"


@dataclass(frozen=True)
class JobLogging:
    """How Hydra set up logging in the job's process (`hydra.job_logging`, resolved, and
    `hydra.verbose`), for the ranks that process spawns: each is a fresh interpreter in which
    nothing set logging up, so rank 0's lines would otherwise reach neither console nor file."""

    config: dict | None
    verbose: bool | str | list = False

    @classmethod
    def of_this_job(cls) -> JobLogging | None:
        """This Hydra job's logging; None outside a Hydra job (a script, a test)."""
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        if not HydraConfig.initialized():
            return None
        hydra_cfg = HydraConfig.get()
        config = hydra_cfg.job_logging
        verbose = hydra_cfg.verbose
        return cls(
            None if config is None else OmegaConf.to_container(config, resolve=True),
            OmegaConf.to_container(verbose) if OmegaConf.is_list(verbose) else verbose,
        )

    def apply(self) -> None:
        """Set this process's logging up as Hydra did the job's (the same code, so the same
        handlers and the same checks of what a config may name)."""
        from hydra.core.utils import configure_log
        from omegaconf import OmegaConf

        config = copy.deepcopy(self.config)
        for handler in ((config or {}).get("handlers") or {}).values():
            if "filename" in handler:
                # The job's process has written its first lines there already: append to them
                # (a handler's mode "w" would erase them).
                handler["mode"] = "a"
        verbose = OmegaConf.create(self.verbose) if isinstance(self.verbose, list) else self.verbose
        configure_log(None if config is None else OmegaConf.create(config), verbose)


def set_up_spawned_rank(job: JobLogging | None) -> None:
    """Logging of a rank the recipe spawned: rank 0 logs as its job does (the console and
    train.log), the others as `RankWarnings`. Outside a Hydra job (`job` None) rank 0 is left
    as Python starts."""
    if _rank() != 0:
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.addHandler(RankWarnings())
        root.setLevel(logging.WARNING)
    elif job is not None:
        job.apply()


class BelowLevel(logging.Filter):
    """Passes records below `level`: the stdout handler leaves errors to the stderr handler."""

    def __init__(self, level: int | str = logging.ERROR):
        super().__init__()
        self.level = logging.getLevelName(level) if isinstance(level, str) else level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def quiet_libraries() -> None:
    """megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that a
    CPU run does not need, and logs FSDP set-up at INFO; keep the console for the recipe."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")
    logging.getLogger("megatron").setLevel(logging.WARNING)
