"""Compose the app's config without running the app: for scripts and tests.

The result is exactly what `python train.py OVERRIDES` sees: the same `conf/` tree, the same
`cp=2` quoting, the same typed validation.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recipe.config import ConfigError, TrainConfig, register_configs
from recipe.config.keys import unknown_key
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
    return to_typed(compose_config(overrides))


def to_typed(cfg: DictConfig) -> TrainConfig:
    """Validate and convert once; raises ConfigError naming the field and the fix. Keys the
    dataclasses do not define are refused even when added with `+` (which Hydra allows and
    OmegaConf's merge into the schema then keeps): a typo must not be silently ignored."""
    for key in _leaf_keys(OmegaConf.to_container(cfg, resolve=False)):
        if problem := unknown_key(key):
            raise ConfigError(problem)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))


def _leaf_keys(values: dict, prefix: str = ""):
    """Every dotted key down to the leaves (`unknown_key` stops where the schema stops)."""
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"
