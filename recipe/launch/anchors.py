"""Train a run's settings from each anchor of its baseline: the anchored check's evidence.

A long run's curves can only be judged against the baseline's own fp32 drift, which grows with
the run; an anchor restores the power to see a small error at any step. The baseline kept its
state at its anchors (`<baseline>/anchors/step_N`, trainer.save_anchor) and recorded the
`compare.anchor_steps` steps after each; this trains the run's recorded config (its layout, its
engine, its mutant from its onset) from each of those states, re-sharded to its layout, for the
same steps on the same data, into `<run>/anchor_probes/step_N/` (metrics.jsonl and per-token
records). Both sides then differ only by how the work was split, as at step 1, whatever the run's
length: `recipe/compare/anchors.py` judges them at rtol and per token. Run as a process of its own
by the comparison (`python -m recipe.launch.anchors RUN_DIR BASELINE_DIR`, its console in
`<run>/anchor_probes/train.log`), its ranks started here when the run had more than one.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from recipe.config import ConfigError, TrainConfig
from recipe.launch.noise_twin import helper_config, helper_main
from recipe.names import ANCHOR_STEPS
from recipe.rundir.job_files import read_job_config
from recipe.rundir.layout import (
    anchor_probe_dir,
    anchor_states,
    metrics_path,
    step_name,
)


def probe_config(run_dir: str | Path) -> TrainConfig:
    """The run's recorded config, writing into its anchor_probes/ (see `helper_config`), with
    no evaluation between the anchors' steps."""
    cfg = helper_config(
        run_dir,
        anchor_probe_dir(run_dir),
        "its layout cannot be trained from the baseline's anchors",
    )
    cfg.trainer.eval_every = 0
    return cfg


def probe_rank(cfg: TrainConfig, baseline: tuple[str, int]) -> None:
    """On every rank: one Trainer, started from each anchor of the baseline in turn for the
    steps the baseline recorded after it (`baseline`: its directory and that count)."""
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.environment import read_environment
    from recipe.launch.rank import share_cores
    from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
    from recipe.model.numerics import apply_determinism
    from recipe.parallel import groups
    from recipe.training.trainer import Trainer

    baseline_dir, steps = baseline
    install_cpu_patches()
    owns_world = not torch.distributed.is_initialized()
    env = read_environment(os.environ)
    layout = groups.init_distributed(cfg.parallel_dims, env, cfg.trainer.collective_timeout_s)
    try:
        share_cores(env.local_world_size)
        seed_model_parallel_rng(cfg.trainer.seed)
        apply_determinism(cfg.trainer.deterministic)
        trainer = Trainer(cfg, layout, env.device, load_corpus(cfg.data, cfg.image_grid))
        for step, state in anchor_states(baseline_dir).items():
            out = Path(cfg.output_dir) / step_name(step)
            trainer.start_from(state)
            trainer.token_dir = str(out)
            trainer.record_steps = {step + k for k in range(1, steps + 1)}
            records = [trainer.train_step().to_record() for _ in range(steps)]
            if layout.is_main:
                out.mkdir(parents=True, exist_ok=True)
                lines = "".join(json.dumps(r) + "\n" for r in records)
                metrics_path(out).write_text(lines)
    finally:
        if owns_world:
            groups.shutdown_distributed()


def probe_here(run_dir: str | Path, baseline_dir: str | Path) -> Path:
    """Train the run's settings from every anchor of the baseline, its ranks started here when
    it has more than one; returns the run's anchor_probes/ directory."""
    from recipe.environment import adopt_environment
    from recipe.launch.local import launch_world
    from recipe.launch.preflight import check_run_choices

    cfg = probe_config(run_dir)
    check_run_choices(cfg, adopt_environment().device)
    if not anchor_states(baseline_dir):
        raise ConfigError(f"{baseline_dir} kept no anchors (compare.anchor_every)")
    root = Path(cfg.output_dir)
    for old in root.glob("step_*"):  # probes of an earlier baseline or an earlier check
        shutil.rmtree(old)
    root.mkdir(parents=True, exist_ok=True)
    recorded = (read_job_config(baseline_dir) or {}).get("compare") or {}
    baseline = (str(baseline_dir), int(recorded.get("anchor_steps", ANCHOR_STEPS)))
    if cfg.world_size == 1:
        probe_rank(cfg, baseline)
    else:
        launch_world(cfg, entrypoint=_probe_worker, checked=baseline)
    return root


def _probe_worker(cfg: TrainConfig, baseline: tuple[str, int]) -> None:
    from recipe.log import quiet_libraries, set_up_spawned_rank

    set_up_spawned_rank(None)
    quiet_libraries()
    probe_rank(cfg, baseline)


def main(argv: list[str]) -> int:
    return helper_main(argv, "recipe.launch.anchors", ["RUN_DIR", "BASELINE_DIR"], probe_here)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
