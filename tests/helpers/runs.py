"""Training runs shared across test modules, each trained once per session.

Several modules compare against the same reference (a cp=1 run of the same config), and some
compare many layouts against it. `SharedRuns` trains a config the first time any test asks for
it, keyed by the whole typed config (so two spellings of the same overrides share one run), in
this process for a world of one and in the session's `WorldPool` otherwise. Runs whose files a
test reads get a run directory of their own, laid out as `python train.py` lays it out.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.helpers.config import compose_config, typed_config
from tests.helpers.world import WorldPool


def config_key(cfg) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)


class SharedRuns:
    def __init__(self, pool: WorldPool, root: Path):
        self.pool = pool
        self.root = Path(root)
        self._results: dict[str, dict] = {}
        self._dirs: dict[str, Path] = {}

    def result(self, overrides: list[str]) -> dict:
        """{"summary", "history"} of `train()` on the tiny config plus `overrides`."""
        cfg = typed_config(list(overrides))
        key = config_key(cfg)
        if key not in self._results:
            self._results[key] = self._train(cfg)
        return self._results[key]

    def history(self, overrides: list[str]) -> list[dict]:
        return self.result(overrides)["history"]

    def run_dir(self, overrides: list[str]) -> Path:
        """The run directory (metrics, summary, checkpoints, records) of a run with outputs."""
        key = config_key(typed_config(list(overrides)))
        if key not in self._dirs:
            run_dir = self.root / f"run{len(self._dirs)}"
            _write_job_config(run_dir, overrides)
            self._train(typed_config(list(overrides), output_dir=run_dir))
            self._dirs[key] = run_dir
        return self._dirs[key]

    def _train(self, cfg) -> dict:
        if cfg.world_size == 1:
            from recipe.launch.rank import train

            return train(cfg)
        return self.pool.train(cfg)


def _write_job_config(run_dir: Path, overrides: list[str]) -> None:
    """`.hydra/config.yaml` as `python train.py` leaves it (the job's composed config), which
    the comparison tools read a run's settings from."""
    from omegaconf import OmegaConf

    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(overrides)))
