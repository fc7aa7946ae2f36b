"""The GPU check's report: report.json and report.md, each replaced whole, and the markdown
table of the parts."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_report(out: Path, report: dict) -> None:
    """report.json and report.md, each replaced whole (a run stopped mid-write leaves the
    previous complete file)."""
    texts = {
        "report.json": json.dumps(report, indent=2, default=str) + "\n",
        "report.md": render_markdown(report),
    }
    for name, text in texts.items():
        unfinished = out / f"{name}.writing"
        unfinished.write_text(text)
        os.replace(unfinished, out / name)


STATUS_NOTES = {
    "pending": "not reached: the run stopped before this part",
    "running": "still running when the report was last written: if the run is over, this part "
    "did not finish (stopped by the time limit, or the process died)",
}


def render_markdown(report: dict) -> str:
    lines = ["# GPU check", "", "| part | status | details |", "|---|---|---|"]
    for name, result in report.items():
        details = {k: v for k, v in result.items() if k not in ("status", "traceback")}
        if result["status"] in STATUS_NOTES:
            details["note"] = STATUS_NOTES[result["status"]]
        lines.append(f"| {name} | {result['status']} | `{json.dumps(details, default=str)}` |")
    if any(result.get("reason") == "no CUDA" for result in report.values()):
        lines += ["", "No CUDA on this machine: nothing but the versions was checked."]
    return "\n".join(lines) + "\n"
