"""Train a baseline's noise twin: its own config with only the sequence order reversed.

The twin goes into `<baseline>/noise_twin/` and is what the comparison learns the baseline's fp32
noise from (recipe/compare/noise.py). It is trained from the baseline's recorded config
(`.hydra/config.yaml`), not recomposed from the command line, so it is the baseline's setting even
when the config files changed since. The comparison runs it as a process of its own
(`python -m recipe.launch.noise_twin BASELINE_DIR`, its console in the twin's `train.log`); a
sweep's baseline job with `compare.noise_floor=twin` trains it in its own process, after itself.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from recipe.config import ConfigError, TrainConfig
from recipe.rundir.job_files import read_job_config
from recipe.rundir.layout import config_path, noise_twin_dir

TWIN_ORDER = {"data": "reversed", "reversed": "data"}
"""The twin sums in the other order from its baseline's."""


def is_sweep_baseline(cfg: TrainConfig, job_num: int) -> bool:
    """Whether a sweep's parity report will judge other jobs against this one: job
    `compare.baseline`, or with `auto` every job of the reference layout."""
    if cfg.compare.baseline != "auto":
        return int(cfg.compare.baseline) == int(job_num)
    return cfg.world_size == 1 and cfg.vision.positions == "full_stream"


def twin_config(baseline_dir: str | Path) -> TrainConfig:
    """The baseline's recorded config with the other sequence order, writing into the twin's
    directory, and nothing that only costs time (checkpoints, per-token records, traces, wandb)."""
    from recipe.launch.task import to_typed

    raw = read_job_config(baseline_dir)
    if raw is None:
        raise ConfigError(
            f"{baseline_dir} has no {config_path(baseline_dir).relative_to(baseline_dir)}: its "
            "noise twin cannot be trained; compare with the fixed tolerance (--noise-floor fixed)"
        )
    raw.pop("output_dir", None)
    cfg = to_typed(OmegaConf.create(raw))
    cfg.batching.sequence_order = TWIN_ORDER[cfg.batching.sequence_order]
    cfg.output_dir = str(noise_twin_dir(baseline_dir))
    trainer = cfg.trainer
    trainer.resume, trainer.requeue, trainer.progress_bar = None, False, False
    trainer.checkpoint_every, trainer.record_tokens, trainer.trace_steps = 0, [], []
    cfg.compare.anchor_every = 0  # a twin is never a baseline: it keeps no anchors
    cfg.logger.wandb.mode = "disabled"
    return cfg


def train_twin_here(baseline_dir: str | Path, fresh: bool = True) -> Path:
    """Train the twin of `baseline_dir` in this process, its ranks started here when it has more
    than one; returns its directory. `fresh`: first discard what an earlier attempt left (the
    comparison, which starts this as a process, clears it itself and logs into it)."""
    from recipe.environment import adopt_environment
    from recipe.launch.local import launch_world
    from recipe.launch.preflight import Preflight, check_run_choices
    from recipe.launch.rank import train

    cfg = twin_config(baseline_dir)
    check_run_choices(cfg, adopt_environment().device)
    twin = Path(cfg.output_dir)
    if fresh:
        shutil.rmtree(twin, ignore_errors=True)
    config_path(twin).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), config_path(twin))  # what it trained, for a look
    checked = Preflight(checkpoint=None)
    if cfg.world_size == 1:
        train(cfg, checked)
    else:
        launch_world(cfg, checked=checked)
    return twin


def main(argv: list[str]) -> int:
    from recipe.log import quiet_libraries

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    if len(argv) != 1:
        print("usage: python -m recipe.launch.noise_twin BASELINE_RUN_DIR", file=sys.stderr)
        return 2
    try:
        train_twin_here(argv[0], fresh=False)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
