"""How each job of a sweep ended, one small file per job under `<sweep dir>/.jobs/`: written by
the job (rank 0) when it ends, read by the sweep's reports (the parity report and the
conventions table). Jobs end concurrently under submitit, so each writes a file of its own."""

from __future__ import annotations

import json
from pathlib import Path

from recipe.rundir.metrics import has_metrics

JOBS_DIR = ".jobs"
"""Under the sweep directory: one `<job number>.json` per finished job, written by the job."""


def record_job(sweep_dir: Path, job_num: int, output_dir: Path, error: str | None) -> None:
    """Note how a job ended, in a file of its own (jobs end concurrently under submitit)."""
    jobs = sweep_dir / JOBS_DIR
    jobs.mkdir(parents=True, exist_ok=True)
    entry = {
        "num": int(job_num),
        "output_dir": str(output_dir),
        "metrics": has_metrics(output_dir),
        "error": error,
    }
    partial = jobs / f".{job_num}.json.partial"
    partial.write_text(json.dumps(entry))
    partial.replace(jobs / f"{job_num}.json")  # a reader never sees half an entry


def recorded_jobs(sweep_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The directories of jobs that wrote metrics and the (directory, error) of failed ones, in
    job order."""
    entries = [json.loads(p.read_text()) for p in (Path(sweep_dir) / JOBS_DIR).glob("*.json")]
    entries.sort(key=lambda e: e["num"])
    job_dirs = [Path(e["output_dir"]) for e in entries if e["metrics"]]
    failures = [(Path(e["output_dir"]), e["error"]) for e in entries if e["error"]]
    return job_dirs, failures
