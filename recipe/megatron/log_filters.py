"""Log records of megatron-core that say nothing a recipe user can act on, filtered at source."""

from __future__ import annotations

import logging


class DropGPTModelDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


def silence_known_warnings() -> None:
    """GPTModel is what the recipe builds on every supported release; 0.19 warns on each build."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, DropGPTModelDeprecation) for f in logger.filters):
        logger.addFilter(DropGPTModelDeprecation())
