"""Run outputs as they happen: metrics.jsonl and summary.json, the console's progress bar, wandb.

Only the main rank writes; every other rank gets a logger whose methods do nothing, so the training
loop never branches on rank. wandb is optional at run time (`logger.wandb.mode=disabled`) and is
always finished, even when training fails. The files themselves (append-only metrics with the
run's name and resume markers, whole lines or nothing) are recipe/rundir/metrics.py's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

from recipe.rundir.metrics import MetricsFile, write_summary


class NullLogger:
    """What ranks other than the main one get."""

    def log_step(self, metrics: dict) -> None:
        pass

    def log_summary(self, summary: dict) -> None:
        pass

    def log_resume(self, *args, **kwargs) -> None:  # see RunLogger.log_resume
        pass

    def log_start(self, run_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class RunLogger(NullLogger):
    def __init__(self, cfg, output_dir: str | None, total_steps: int, first_step: int = 0):
        self.output_dir = Path(output_dir) if output_dir else None
        self._metrics = None
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = MetricsFile(self.output_dir)
        self._bar = None
        if cfg.trainer.progress_bar:
            from tqdm.auto import tqdm

            # In a log file (CI, SLURM) every refresh is another line's worth of text: refresh
            # rarely there, often on a terminal.
            interactive = sys.stderr.isatty()
            self._bar = tqdm(
                total=total_steps,
                initial=first_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=0.1 if interactive else 30.0,
            )
        self._log_every = cfg.trainer.log_every
        self._wandb = self._start_wandb(cfg)

    def _start_wandb(self, cfg):
        wcfg = cfg.logger.wandb
        if wcfg.mode == "disabled":
            return None
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run_dir = str(self.output_dir) if self.output_dir else None
        return wandb.init(
            mode=wcfg.mode,
            project=wcfg.project,
            group=wcfg.group,
            tags=list(wcfg.tags) or None,
            dir=run_dir,
            config=asdict(cfg),
            reinit="finish_previous",
        )

    def log_start(self, run_id: str) -> None:
        """Name the run in the first line of a new metrics.jsonl (a directory that already has
        lines keeps its own first line)."""
        if self._metrics is not None:
            self._metrics.start(run_id)

    def log_resume(
        self,
        step: int,
        history: list[dict],
        checkpoint,
        changes: list[str],
        run_id: str = "",
        set_aside: list = (),
    ) -> None:
        """Mark where a resumed run takes over. A new run directory first gets the run's name
        and the checkpoint's own records, so each run directory holds the whole curve."""
        if self._metrics is not None:
            self._metrics.resume(step, history, checkpoint, changes, run_id, set_aside)

    def log_step(self, metrics: dict) -> None:
        if self._metrics is not None:
            self._metrics.append([metrics])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"])
        if self._bar is not None:
            self._bar.update(1)
            if metrics["step"] % self._log_every == 0 or "eval_lm_loss" in metrics:
                postfix = {
                    "loss": f"{metrics['loss']:.4f}",
                    "tok/s": f"{metrics['tokens_per_s']:.0f}",
                }
                if "eval_lm_loss" in metrics:
                    postfix["eval"] = f"{metrics['eval_lm_loss']:.4f}"
                self._bar.set_postfix(postfix)

    def log_summary(self, summary: dict) -> None:
        if self.output_dir is not None:
            write_summary(self.output_dir, summary)
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
