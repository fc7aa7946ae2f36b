"""Console and log-file output: one logger per module that speaks on rank 0 only.

Hydra configures Python logging for every job (`conf/hydra/job_logging/recipe.yaml`): messages
go to the console as plain text (information to stdout, errors to stderr) and, with timestamps,
to `<run dir>/train.log`, so the log file holds what the console showed. Under torchrun every
rank runs the app; `get_logger` drops information from ranks other than 0 (their output would
repeat rank 0's) but lets warnings and errors through from every rank.
"""

from __future__ import annotations

import logging
import os


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
