"""Console and log-file output of the recipe."""

from __future__ import annotations


def quiet_libraries() -> None:
    """megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that a
    CPU run does not need, and logs FSDP set-up at INFO; keep the console for the recipe."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.")
    logging.getLogger("megatron").setLevel(logging.WARNING)
