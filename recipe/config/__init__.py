"""Typed configuration: one dataclass per Hydra group, checked at start-up.

The YAML files under `conf/` compose and sweep; these schemas (registered in Hydra's ConfigStore)
reject unknown keys and wrong types, and each `__post_init__` rejects values that cannot work, with
a message that names the field and what would be valid. `train.py` converts the composed config to
these objects once; the code below it only sees typed values. `groups` holds the groups, `schema`
the whole run and the rules across groups, `layout` the parallel grid's arithmetic and degree
rules, `preprocess` what a `cp.preprocess` string names, `keys` which dotted keys exist (for the
command line's typos), `reference` the generated docs page.
"""

from recipe.config.groups import (
    BatchingConfig,
    CompareConfig,
    ConventionConfig,
    ConventionSource,
    CPConfig,
    DataConfig,
    LoggerConfig,
    LossSpikeConfig,
    MarkovConfig,
    MegatronEngineConfig,
    ModelConfig,
    MTPConfig,
    MutantConfig,
    OptimConfig,
    ParallelConfig,
    ShapesConfig,
    TrainerConfig,
    VisionConfig,
    WandbConfig,
)
from recipe.config.schema import TrainConfig, register_configs
from recipe.errors import ConfigError

__all__ = [
    "BatchingConfig",
    "CPConfig",
    "CompareConfig",
    "ConventionConfig",
    "MutantConfig",
    "ConventionSource",
    "ConfigError",
    "DataConfig",
    "LoggerConfig",
    "LossSpikeConfig",
    "MTPConfig",
    "MarkovConfig",
    "MegatronEngineConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ShapesConfig",
    "TrainConfig",
    "TrainerConfig",
    "VisionConfig",
    "WandbConfig",
    "register_configs",
]
