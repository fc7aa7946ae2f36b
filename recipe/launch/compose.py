"""Compose the app's config without running the app: for scripts and tests.

The result is exactly what `python train.py OVERRIDES` sees: the same `conf/` tree, the same
`cp=2` quoting, the same typed validation.
"""

from __future__ import annotations

from pathlib import Path

from recipe.config import TrainConfig, register_configs
from recipe.launch.overrides import quote_numeric_group_choices

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str] | None = None, return_hydra_config: bool = False):
    """The composed DictConfig of `train.yaml` with `overrides`."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "train",
            overrides=quote_numeric_group_choices(list(overrides or [])),
            return_hydra_config=return_hydra_config,
        )


def compose_typed(overrides: list[str] | None = None) -> TrainConfig:
    """The typed config; raises ConfigError naming the field and the fix."""
    from recipe.launch.task import to_typed

    return to_typed(compose_config(overrides))
