"""Run outputs: metrics.jsonl (one line per optimizer step), summary.json, console, wandb.

Only the main rank writes; every other rank gets a logger whose methods do nothing, so the training
loop never branches on rank. wandb is optional at run time (`logger.wandb.mode=disabled`) and is
always finished, even when training fails.

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
import sys
from dataclasses import asdict
from pathlib import Path

from recipe.errors import RecipeError

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


RESUMED = "resumed"
RUN = "run"


class OutputWriteError(RecipeError, OSError):
    """A run output could not be written; the message names the file and the cause."""


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
            # Append: the run directory's lock lets a job in only when the file is empty or the
            # job resumes this run.
            self._metrics = open(self.output_dir / METRICS_FILE, "ab", buffering=0)  # noqa: SIM115
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

    def _append(self, records: list[dict]) -> None:
        """Append whole lines, or on failure nothing: the file is cut back to where it was."""
        if self._metrics is None:
            return
        path = self.output_dir / METRICS_FILE
        fd = self._metrics.fileno()
        before = os.fstat(fd).st_size
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        try:
            while data:  # unbuffered: a short write is retried, a failed one is undone below
                data = data[os.write(fd, data) :]
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, before)
            raise OutputWriteError(
                f"could not write {path}: {err.strerror or err}; it keeps its {before} bytes "
                "of whole lines (free space there and resume with trainer.resume=auto)"
            ) from None

    def log_start(self, run_id: str) -> None:
        """Name the run in the first line of a new metrics.jsonl (a directory that already has
        lines keeps its own first line)."""
        if self._metrics is not None and (self.output_dir / METRICS_FILE).stat().st_size == 0:
            self._append([{RUN: {"id": run_id}}])

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
        if self._metrics is None:
            return
        path = self.output_dir / METRICS_FILE
        size = path.stat().st_size
        if size and not path.read_bytes().endswith(b"\n"):
            os.write(self._metrics.fileno(), b"\n")  # a line cut short by a kill stays apart
        marker = {
            RESUMED: {
                "from_step": step,
                "checkpoint": None if checkpoint is None else str(checkpoint),
                "changed": changes,
                "set_aside": [str(p) for p in set_aside],
            }
        }
        head = [{RUN: {"id": run_id}}, *history] if not size else []
        self._append(head + [marker])

    def log_step(self, metrics: dict) -> None:
        self._append([metrics])
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
            path = self.output_dir / SUMMARY_FILE
            tmp = path.with_name(path.name + ".tmp")
            try:
                tmp.write_text(json.dumps(summary, indent=2) + "\n")
                os.replace(tmp, path)
            except OSError as err:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise OutputWriteError(f"could not write {path}: {err.strerror or err}") from None
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


def run_id_in(run_dir: str | Path) -> str | None:
    """The id of the run whose metrics a run directory holds (its first line), or None (no
    metrics, or written before runs had ids)."""
    path = Path(run_dir) / METRICS_FILE
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
    path = Path(run_dir) / METRICS_FILE
    return parse_metrics_lines(path.read_text().splitlines())[0]
