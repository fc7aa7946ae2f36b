"""Hydra callback: at the end of every multirun, judge the jobs against their baselines.

Jobs run one after another with Hydra's basic launcher, each in its own numbered directory and
each launching its own ranks. The callback remembers every job's directory as it finishes and, when
the sweep ends, writes `parity_report.md` and `loss_curves.png` into the sweep directory.
"""

from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from recipe.compare import find_runs, write_report


class ParityReportCallback(Callback):
    def __init__(self) -> None:
        self.job_dirs: list[Path] = []

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        output_dir = config.hydra.runtime.output_dir
        if (Path(output_dir) / "metrics.jsonl").exists():
            self.job_dirs.append(Path(output_dir))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not self.job_dirs:
            print("parity report: no job wrote metrics, nothing to compare")
            return
        sweep_dir = self.job_dirs[0].parent
        runs = find_runs(self.job_dirs)
        baseline_choice = str(config.compare.baseline)
        baseline = None
        if baseline_choice != "auto":
            matches = [r for r in runs if r.path.name == baseline_choice]
            if not matches:
                print(
                    f"parity report: compare.baseline={baseline_choice} is not a job of this "
                    f"sweep (jobs: {', '.join(r.path.name for r in runs)})"
                )
                return
            baseline = matches[0]
        report, passed = write_report(
            runs, sweep_dir, rtol=float(config.compare.rtol), baseline=baseline
        )
        print(report)
        verdict = "all PASS" if passed else "some FAIL"
        print(
            f"parity report ({verdict}): {sweep_dir / 'parity_report.md'}, "
            f"{sweep_dir / 'loss_curves.png'}"
        )
