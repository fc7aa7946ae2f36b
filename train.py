"""Entry point: `python train.py [overrides]`, e.g. `python train.py cp=2 trainer.max_steps=50`.

Thin by design: compose and validate the config, then hand a typed config to recipe's `run`.
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from recipe.config import register_configs
from recipe.errors import ConfigError
from recipe.host_memory import bound_host_memory
from recipe.launch.overrides import (
    check_group_choices,
    check_launcher_plugin,
    check_output_directory,
    check_override_keys,
    quote_numeric_group_choices,
    run_dir_for_launched_rank,
)

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from recipe.launch.task import run

    return run(cfg)


if __name__ == "__main__":
    from importlib.util import find_spec

    plugin = find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    conf = Path(__file__).parent / "conf"
    problem = (
        check_launcher_plugin(sys.argv[1:], plugin)
        or check_group_choices(sys.argv[1:], conf)
        or check_override_keys(sys.argv[1:], conf)
        or check_output_directory(sys.argv[1:], Path.cwd())
    )
    if problem:
        print(f"config error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        sys.argv[1:] = run_dir_for_launched_rank(
            quote_numeric_group_choices(sys.argv[1:]), os.environ
        )
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    bound_host_memory()  # before the first matrix product, and inherited by every rank
    main()
