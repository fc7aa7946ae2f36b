"""Hydra callback: at the end of every multirun, judge the jobs against their baselines.

Jobs run one after another with Hydra's basic launcher, each in its own numbered directory and
each launching its own ranks. The callback remembers every job's directory as it finishes and, when
the sweep ends, writes `parity_report.md` and `loss_curves.png` into the sweep directory. A failed
job stops the sweep; the report is then written at once, with the failure in it. It prints rather
than logs: it runs in Hydra's launcher process after the jobs, where logging carries Hydra's own
`[HYDRA]` prefix and no job's train.log is the right file; the report is its own file.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from recipe.compare.report import write_report
from recipe.compare.runs import find_runs
from recipe.training.loggers import METRICS_FILE


class ParityReportCallback(Callback):
    def __init__(self) -> None:
        self.job_dirs: list[Path] = []
        self.failures: list[tuple[str, str]] = []
        self.compare_cfg = None

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        output_dir = Path(config.hydra.runtime.output_dir)
        self.compare_cfg = config.compare
        if (output_dir / METRICS_FILE).exists():
            self.job_dirs.append(output_dir)
        if job_return.status == JobStatus.FAILED:
            error = str(job_return._return_value).strip().splitlines()
            self.failures.append((output_dir.name, error[0] if error else "unknown error"))
            self._write(output_dir.parent)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.job_dirs:
            self._write(self.job_dirs[0].parent)
        else:
            print("parity report: no job wrote metrics, nothing to compare")

    def _write(self, sweep_dir: Path) -> None:
        runs = find_runs(self.job_dirs) if self.job_dirs else []
        choice = str(self.compare_cfg.baseline)
        baseline = None
        if choice != "auto":
            matches = [r for r in runs if r.path.name == choice]
            if not matches:
                print(
                    f"parity report: compare.baseline={choice} is not a job of this sweep "
                    f"(jobs: {', '.join(r.path.name for r in runs)})"
                )
                return
            baseline = matches[0]
        report, passed = write_report(
            runs,
            sweep_dir,
            rtol=float(self.compare_cfg.rtol),
            baseline=baseline,
            failures=self.failures,
        )
        print(report)
        verdict = "all PASS" if passed else "some FAIL"
        print(
            f"parity report ({verdict}): {sweep_dir / 'parity_report.md'}, "
            f"{sweep_dir / 'loss_curves.png'}"
        )
