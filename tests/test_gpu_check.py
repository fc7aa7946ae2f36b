"""scripts/gpu_check.py on a machine without CUDA: an honest report and exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.launches
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs every part")
def test_gpu_check_without_cuda_reports_every_part_skipped(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["versions"]["status"] == "info" and report["versions"]["torch"]
    parts = [name for name in report if name != "versions"]
    assert len(parts) == 6
    assert all(report[p]["status"] == "skipped" for p in parts)
    assert all(report[p]["reason"] == "no CUDA" for p in parts)
    assert "nothing but the versions was checked" in (tmp_path / "report.md").read_text()
