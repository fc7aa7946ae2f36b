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


def helper_config(run_dir: str | Path, output_dir: str | Path, refusal: str) -> TrainConfig:
    """A run's recorded config for a helper run of it (its noise twin, its anchored check),
    writing into `output_dir`, and nothing that only costs time (checkpoints, anchors, per-token
    records, traces, wandb); `refusal` says what cannot be done when the run recorded none."""
    from recipe.launch.compose import to_typed

    raw = read_job_config(run_dir)
    if raw is None:
        raise ConfigError(
            f"{run_dir} has no {config_path(run_dir).relative_to(run_dir)}: {refusal}"
        )
    raw.pop("output_dir", None)
    cfg = to_typed(OmegaConf.create(raw))
    cfg.output_dir = str(output_dir)
    trainer = cfg.trainer
    trainer.resume, trainer.requeue, trainer.progress_bar = None, False, False
    trainer.checkpoint_every, trainer.record_tokens, trainer.trace_steps = 0, [], []
    cfg.compare.anchor_every = 0  # a helper run is never a baseline: it keeps no anchors
    cfg.logger.wandb.mode = "disabled"
    return cfg


def twin_config(baseline_dir: str | Path) -> TrainConfig:
    """The baseline's recorded config with the other sequence order, writing into the twin's
    directory (see `helper_config`)."""
    cfg = helper_config(
        baseline_dir,
        noise_twin_dir(baseline_dir),
        "its noise twin cannot be trained; compare with the fixed tolerance (--noise-floor fixed)",
    )
    cfg.batching.sequence_order = TWIN_ORDER[cfg.batching.sequence_order]
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


def helper_main(argv: list[str], module: str, operands: list[str], run) -> int:
    """The command line of a helper process: `python -m MODULE OPERANDS...`, exit 2 with the
    usage or a config error, 0 once `run(*argv)` is done."""
    from recipe.log import quiet_libraries

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_libraries()
    if len(argv) != len(operands):
        print(f"usage: python -m {module} {' '.join(operands)}", file=sys.stderr)
        return 2
    try:
        run(*argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


def _train_twin_cli(baseline_dir: str) -> None:
    train_twin_here(baseline_dir, fresh=False)


def main(argv: list[str]) -> int:
    return helper_main(argv, "recipe.launch.noise_twin", ["BASELINE_RUN_DIR"], _train_twin_cli)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
