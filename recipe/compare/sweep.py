"""Hydra callback: at the end of every multirun, judge the jobs against their baselines.

Jobs run one after another with Hydra's basic launcher, each in its own numbered directory and
each launching its own ranks; with the submitit launchers (hydra/launcher=slurm, submitit_local)
they run at the same time, each in a process of its own, and Hydra calls `on_job_end` there, in
the job, while `on_multirun_end` runs in the process that submitted the sweep. So every job records
how it ended in a file of its own under `<sweep dir>/.jobs/` (rank 0 only), and the report is
built from those files: the same in either case. When the sweep ends the callback writes
`parity_report.md` and `loss_curves.png` into the sweep directory (and only there, and only in a
multirun: a single run, or a torchrun rank, writes no report). At the start it
removes a previous sweep's report from a reused sweep directory and checks `compare.*` against the
sweep's job count, so a bad baseline stops the sweep before the first job. A failed job does not
stop the sweep: Hydra's basic launcher runs every job in turn (the submitit ones run them at
once), and only then ends the sweep with the first failed job's error, exit 1, without calling
`on_multirun_end`. So from the first failure on, the report is written as each job ends, with every
failure so far in it; the last job's leaves the whole picture. A report with a FAIL makes the
sweep exit 1 (`compare.fail_exit_code`). It prints rather
than logs: it runs in Hydra's launcher process after the jobs, where logging carries Hydra's own
`[HYDRA]` prefix and no job's train.log is the right file; the report is its own file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recipe.compare.conventions import CONVENTIONS_FILE, sweep_tables, uses_conventions
from recipe.compare.jobs import JOBS_DIR, record_job, recorded_jobs
from recipe.compare.report import (
    MUTATION_FILE,
    PLOT_FILE,
    REPORT_FILE,
    is_mutant_sweep,
    write_report,
)
from recipe.compare.runs import find_runs
from recipe.config import CompareConfig, ConfigError
from recipe.environment import read_environment
from recipe.rundir.layout import LOCK_FILE


def count_sweep_jobs(config: DictConfig) -> int | None:
    """How many jobs Hydra's basic sweeper will run for this multirun (None if unknown)."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        params = config.hydra.sweeper.get("params") or {}
        overrides = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
        parsed = OverridesParser.create().parse_overrides(overrides)
        return sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:  # another sweeper, or Hydra internals moved: check at the end instead
        return None


def check_compare_config(config: DictConfig, jobs: int | None) -> CompareConfig:
    """`compare.*` as the sweep will use it, refused before any job runs when it cannot work."""
    compare = CompareConfig(**OmegaConf.to_container(config.compare, resolve=True))
    if compare.baseline != "auto" and jobs is not None and int(compare.baseline) >= jobs:
        raise ConfigError(
            f"compare.baseline={compare.baseline} is not a job of this sweep: it runs {jobs} "
            f"jobs, numbered 0 to {jobs - 1}; use one of those or compare.baseline=auto"
        )
    return compare


def error_summary(text: str) -> str:
    """One line for a failed job: the error's first line, and where a rank's traceback is
    quoted, its exception and the innermost frame outside the recipe (`package/file.py:LINE`,
    e.g. megatron-core's), so a report names the upstream line that raised."""
    lines = text.strip().splitlines()
    if not lines:
        return "unknown error"
    head = lines[0]
    exception = next((ln.strip() for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), None)
    if exception is None or exception in head:
        return head
    frames = [m for m in map(_FRAME_LINE.search, lines) if m and "/recipe/" not in m["file"]]
    where = ""
    if frames:
        file = frames[-1]["file"]
        file = file.split("site-packages/", 1)[-1]
        where = f" at {file}:{frames[-1]['line']}"
    return f"{head.rstrip(':')}: {exception}{where}"


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b[^ ]*: ")
_FRAME_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


@contextlib.contextmanager
def _report_lock(sweep_dir: Path):
    """Jobs that end at the same moment take turns writing the report."""
    (sweep_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / JOBS_DIR / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class ParityReportCallback(Callback):
    def __init__(self) -> None:
        self.compare_cfg: CompareConfig | None = None
        self.sweep_dir: Path | None = None
        """Set only in a multirun: reports belong to sweeps."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            self.compare_cfg = check_compare_config(config, count_sweep_jobs(config))
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        self.sweep_dir = Path(config.hydra.sweep.dir)
        shutil.rmtree(self.sweep_dir / JOBS_DIR, ignore_errors=True)
        for name in (REPORT_FILE, PLOT_FILE, CONVENTIONS_FILE, MUTATION_FILE):
            # A reused sweep directory must not show an old verdict if this sweep ends early.
            (self.sweep_dir / name).unlink(missing_ok=True)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if self.sweep_dir is None:
            return
        if read_environment(os.environ).rank != 0:
            return  # another task of the same multi-task job: rank 0 speaks for it
        output_dir = Path(config.hydra.runtime.output_dir)
        error = None
        if job_return.status == JobStatus.FAILED:
            error = error_summary(str(job_return._return_value))
        record_job(self.sweep_dir, config.hydra.job.num, output_dir, error)
        _, failures = recorded_jobs(self.sweep_dir)
        if failures:  # Hydra skips on_multirun_end when a job failed: the report is written now
            with _report_lock(self.sweep_dir):
                self._write()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.sweep_dir is None:
            return
        job_dirs, _ = recorded_jobs(self.sweep_dir)
        if not job_dirs:
            print("parity report: no job wrote metrics, nothing to compare")
            self._exit_if_failed(passed=False)
            return
        self._exit_if_failed(self._write())

    def _exit_if_failed(self, passed: bool) -> None:
        if not passed and self.compare_cfg.fail_exit_code:
            raise SystemExit(1)

    def _write(self) -> bool:
        """Write the report into the sweep directory; True when every comparison passed."""
        sweep_dir = self.sweep_dir
        job_dirs, failures = recorded_jobs(sweep_dir)
        runs = find_runs(job_dirs) if job_dirs else []
        choice = str(self.compare_cfg.baseline)
        baseline = None
        if choice != "auto":
            matches = [r for r in runs if r.path.name == choice]
            if not matches:
                print(
                    f"parity report: compare.baseline={choice} is not a job of this sweep "
                    f"(jobs: {', '.join(r.path.name for r in runs)})"
                )
                return False
            baseline = matches[0]
        report, passed = write_report(
            runs,
            sweep_dir,
            rtol=float(self.compare_cfg.rtol),
            baseline=baseline,
            failures=[(path.name, error) for path, error in failures],
            noise_floor=self.compare_cfg.noise_floor,
            margin=float(self.compare_cfg.noise_margin),
        )
        print(report)
        if (sweep_dir / MUTATION_FILE).is_file() and is_mutant_sweep(runs):
            # passing means every mutant caught and every correct run PASSing, not "all PASS"
            verdict = "every mutant caught" if passed else "a mutant missed or a correct run FAILed"
            print(f"training mutation score ({verdict}): {sweep_dir / MUTATION_FILE}")
        else:
            verdict = "all PASS" if passed else "some FAIL"
        print(f"parity report ({verdict}): {sweep_dir / REPORT_FILE}, {sweep_dir / PLOT_FILE}")
        if uses_conventions(runs):  # a row per convention (or ablation) and layout
            sweep = [(sweep_dir.name, runs, failures)]
            table = sweep_tables(sweep, float(self.compare_cfg.rtol))
            (sweep_dir / CONVENTIONS_FILE).write_text(table)
            print(f"conventions table: {sweep_dir / CONVENTIONS_FILE}")
        return passed
