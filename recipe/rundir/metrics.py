"""metrics.jsonl and summary.json: the run's records, written append-only and read back.

metrics.jsonl is only ever appended to. Its first line names the run, `{"run": {"id": ...}}`: the
identity every checkpoint of the run also carries, so a resume can tell its own run directory from
another run's. A resumed run first appends a marker line,
`{"resumed": {"from_step": N, ...}}`: the records after it replace those of steps after N before
it (the steps the interrupted run took past its last checkpoint). `effective_records` applies
that rule for every reader. A write that fails (a full disk) is undone to the last whole line and
raised naming the file, so the file never ends in half a record.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from recipe.errors import RecipeError
from recipe.rundir.layout import metrics_path, summary_path

RESUMED = "resumed"
RUN = "run"


class OutputWriteError(RecipeError, OSError):
    """A run output could not be written; the message names the file and the cause."""


class MetricsFile:
    """A run directory's metrics.jsonl, open for appending whole lines (the main rank's)."""

    def __init__(self, run_dir: str | Path):
        self.path = metrics_path(run_dir)
        # Append: the run directory's lock lets a job in only when the file is empty or the
        # job resumes this run.
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115

    def append(self, records: list[dict]) -> None:
        """Append whole lines, or on failure nothing: the file is cut back to where it was."""
        fd = self._file.fileno()
        before = os.fstat(fd).st_size
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        try:
            while data:  # unbuffered: a short write is retried, a failed one is undone below
                data = data[os.write(fd, data) :]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            raise OutputWriteError(
                f"could not write {self.path}: {err.strerror or err}; it keeps its {before} bytes "
                "of whole lines (free space there and resume with trainer.resume=auto)"
            ) from None

    def start(self, run_id: str) -> None:
        """Name the run in the first line of a new metrics.jsonl (a file that already has lines
        keeps its own first line)."""
        if self.path.stat().st_size == 0:
            self.append([{RUN: {"id": run_id}}])

    def resume(
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
        size = self.path.stat().st_size
        if size and not self.path.read_bytes().endswith(b"\n"):
            os.write(self._file.fileno(), b"\n")  # a line cut short by a kill stays apart
        marker = {
            RESUMED: {
                "from_step": step,
                "checkpoint": None if checkpoint is None else str(checkpoint),
                "changed": changes,
                "set_aside": [str(p) for p in set_aside],
            }
        }
        head = [{RUN: {"id": run_id}}, *history] if not size else []
        self.append(head + [marker])

    def close(self) -> None:
        self._file.close()


def write_summary(run_dir: str | Path, summary: dict) -> None:
    """summary.json, replaced whole (a reader never sees half of it)."""
    path = summary_path(run_dir)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputWriteError(f"could not write {path}: {err.strerror or err}") from None


def effective_records(records: list[dict]) -> list[dict]:
    """The step records of a metrics.jsonl after resumes: a resume marker removes the records
    of steps after its `from_step` that came before it."""
    out: list[dict] = []
    for record in records:
        if RUN in record and "step" not in record:
            continue
        if RESUMED in record:
            from_step = record[RESUMED]["from_step"]
            out = [r for r in out if r["step"] <= from_step]
        else:
            out.append(record)
    return out


def parse_metrics_lines(lines: list[str]) -> tuple[list[dict], list[int]]:
    """Records of metrics.jsonl lines, and the numbers of lines cut short by a kill (the last
    line, or one right before a resume marker); any other line that is not JSON raises."""
    records, cut = [], []
    lines = [line for line in lines if line.strip()]
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            following = lines[number] if number < len(lines) else None
            if following is None or f'"{RESUMED}"' in following:
                cut.append(number)
                continue
            raise ValueError(f"line {number} is not JSON: {err}") from err
    return effective_records(records), cut


def has_metrics(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a metrics.jsonl (a run directory, or a job that got as far)."""
    return metrics_path(run_dir).exists()


def holds_metrics(run_dir: str | Path) -> bool:
    """Whether `run_dir`'s metrics.jsonl has any line: a run has written there."""
    path = metrics_path(run_dir)
    return path.is_file() and path.stat().st_size > 0


def run_id_in(run_dir: str | Path) -> str | None:
    """The id of the run whose metrics a run directory holds (its first line), or None (no
    metrics, or written before runs had ids)."""
    path = metrics_path(run_dir)
    if not path.is_file():
        return None
    with open(path) as f:
        first = f.readline()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return None
    return record.get(RUN, {}).get("id") if isinstance(record, dict) else None


def read_metrics(run_dir: str | Path) -> list[dict]:
    return parse_metrics_lines(metrics_path(run_dir).read_text().splitlines())[0]
