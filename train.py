"""Entry point: `python train.py [overrides]`, e.g. `python train.py cp=2 trainer.max_steps=50`.

Thin by design: compose and validate the config, then hand a typed config to recipe's `run`.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from recipe.config import register_configs
from recipe.launch.overrides import (
    check_group_choices,
    check_launcher_plugin,
    quote_numeric_group_choices,
    single_run_dir_for_rank,
)

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from recipe.launch.task import run

    return run(cfg)


if __name__ == "__main__":
    from importlib.util import find_spec

    plugin = find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    problem = check_launcher_plugin(sys.argv[1:], plugin) or check_group_choices(
        sys.argv[1:], Path(__file__).parent / "conf"
    )
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = single_run_dir_for_rank(quote_numeric_group_choices(sys.argv[1:]), os.environ)
    main()
