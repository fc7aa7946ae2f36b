"""The noise floor: each step's tolerance learned from the baseline's noise twin.

Synthetic runs check the rule (a run drifting like the twin passes where a fixed rtol fails it,
a bug from the first steps still fails, the twin is trained only when needed); one real twin,
trained from a real run's recorded config, checks that the twin is the baseline's setting with
only the sum order changed: close to it, and not bit-identical (or it would measure nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from recipe.compare.__main__ import main as compare_main
from recipe.compare.diff import compare_all
from recipe.compare.judge import judge
from recipe.compare.noise import envelope, floor_from_twin, stored_floor
from recipe.compare.report import render_markdown
from recipe.compare.runs import find_runs, load_run
from recipe.rundir.layout import noise_twin_dir

RTOL = 1e-5
STEPS = 120


def write_run(path: Path, cp: int, lm: list[float], grad: list[float] | None = None) -> Path:
    (path / ".hydra").mkdir(parents=True)
    config = {  # the sections a train.py run records, enough for a twin to be trainable
        "cp": {"size": cp},
        "parallel": {"dp": 1, "tp": 1},
        "model": {"name": "tiny"},
        "data": {},
        "batching": {},
        "trainer": {"max_steps": len(lm)},
    }
    (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    grad = grad or [1.0] * len(lm)
    rows = [{"step": s + 1, "lm_loss": x, "grad_norm": g} for s, (x, g) in enumerate(zip(lm, grad))]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def curve() -> list[float]:
    return [3.0 / (1 + 0.05 * s) + 1.0 for s in range(STEPS)]


def drifted(values: list[float], start: float, growth: float = 1.08) -> list[float]:
    """`values` off by a relative drift that starts at `start` and grows each step, as fp32
    rounding carried by training does."""
    return [v * (1 + start * growth**s) for s, v in enumerate(values)]


def with_twin(root: Path, twin_start: float = 1e-7) -> Path:
    base = write_run(root / "0", 1, curve())
    write_run(noise_twin_dir(base), 1, drifted(curve(), twin_start))
    return base


def test_the_floor_is_the_running_maximum_of_the_twins_drift(tmp_path):
    base = write_run(tmp_path / "b", 1, [1.0, 1.0, 1.0, 1.0])
    twin = write_run(tmp_path / "t", 1, [1.0, 1.0 + 2e-6, 1.0, 1.0 + 1e-6])
    drift = envelope(load_run(base), load_run(twin), "lm_loss")
    assert drift == pytest.approx({1: 0.0, 2: 2e-6, 3: 2e-6, 4: 2e-6}, rel=1e-5)
    floor = floor_from_twin(load_run(base), load_run(twin), ["lm_loss"], margin=10)
    assert floor.threshold("lm_loss", 1, RTOL) == RTOL  # never below rtol
    assert floor.threshold("lm_loss", 3, 1e-6) == pytest.approx(2e-5, rel=1e-5)


def test_a_drift_like_the_twins_passes_and_a_bug_from_the_first_steps_fails(tmp_path):
    with_twin(tmp_path)
    write_run(tmp_path / "1", 2, drifted(curve(), 3e-7))  # 3x the twin's drift: correct
    write_run(tmp_path / "2", 2, [v * (1 + 2e-4) for v in curve()])  # wrong from step 1
    late = drifted(curve(), 1e-7)
    late[100:] = [v * 1.05 for v in late[100:]]  # correct, then 5% off: far past the noise
    write_run(tmp_path / "3", 2, late)
    runs = find_runs([tmp_path])
    assert [r.path.name for r in runs] == ["0", "1", "2", "3"]  # the twin is not a run
    fixed = compare_all(runs, RTOL)
    assert [c.passed for c in fixed] == [None, False, False, False]
    floors = {runs[0].path: stored_floor(runs[0], ["lm_loss", "grad_norm"])}
    judged = compare_all(runs, RTOL, floors=floors)
    assert [c.passed for c in judged] == [None, True, False, False]
    ok, bug, jump = (c.diffs[0] for c in judged[1:])
    assert 0.2 < ok.worst_ratio < 0.5  # 3x the drift against a margin of 10x
    assert bug.worst_ratio == pytest.approx(20, rel=1e-3)  # 2e-4 / rtol, from step 1 on
    assert jump.worst_step == 101 and jump.worst_ratio > 10


def test_auto_trains_a_twin_only_when_a_run_fails_at_rtol(tmp_path):
    trained = []

    def train_twin(base: Path) -> Path:
        trained.append(base.name)
        return write_run(noise_twin_dir(base), 1, drifted(curve(), 1e-7))

    write_run(tmp_path / "0", 1, curve())
    write_run(tmp_path / "1", 2, curve()[:30])  # short: within rtol, no twin needed
    base = load_run(tmp_path / "0")
    short = judge([base, load_run(tmp_path / "1")], RTOL, base, train_twin=train_twin)
    assert trained == [] and short[1].passed is False  # fails on its missing steps only
    write_run(tmp_path / "2", 2, drifted(curve(), 3e-7))
    runs = [load_run(tmp_path / "0"), load_run(tmp_path / "2")]
    assert [c.passed for c in judge(runs, RTOL, noise_floor="fixed", train_twin=train_twin)] == [
        None,
        False,
    ]
    assert trained == []
    assert [c.passed for c in judge(runs, RTOL, train_twin=train_twin)] == [None, True]
    assert trained == ["0"]
    assert judge(runs, RTOL, train_twin=train_twin)[1].passed and trained == ["0"]  # reused
    cut = write_run(tmp_path / "cut" / "0", 1, curve())
    config = cut / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace(f"max_steps: {STEPS}", "max_steps: 500"))
    write_run(tmp_path / "cut" / "1", 2, drifted(curve(), 3e-7))
    cut_runs = find_runs([tmp_path / "cut"])
    (result,) = judge(cut_runs, RTOL, cut_runs[0], train_twin=train_twin)[1:]
    assert trained == ["0"] and result.passed is False, "no twin of a baseline cut short"
    assert f"logged {STEPS} of its trainer.max_steps=500 steps" in result.notes[-1]
    shutil.rmtree(noise_twin_dir(tmp_path / "0"))
    passing = [load_run(tmp_path / "0"), load_run(tmp_path / "0")]
    judge(passing[:1] + [load_run(tmp_path / "2")], RTOL, noise_floor="twin", train_twin=train_twin)
    assert trained == ["0", "0"]


def test_a_twin_cut_short_is_refused_with_the_fix(tmp_path):
    base = write_run(tmp_path / "0", 1, curve())
    write_run(noise_twin_dir(base), 1, curve()[:50])
    with pytest.raises(ValueError, match="lacks 70 of the baseline's steps .*delete it"):
        stored_floor(load_run(base), ["lm_loss"])


def test_the_report_and_the_command_line_say_which_floor_judged(tmp_path, capsys):
    with_twin(tmp_path)
    write_run(tmp_path / "1", 2, drifted(curve(), 3e-7))
    assert compare_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Tolerance per baseline:" in out and "noise twin" in out and "**PASS**" in out
    assert compare_main([str(tmp_path), "--noise-floor", "fixed"]) == 1
    out = capsys.readouterr().out
    assert "rtol 1e-05 on every step (no noise twin)" in out and "**FAIL**" in out
    assert compare_main([str(tmp_path), "--noise-margin", "0"]) == 2
    report = render_markdown(compare_all(find_runs([tmp_path]), RTOL), RTOL)
    assert "worst / tolerance" in report


@pytest.mark.launches
@pytest.mark.distributed
def test_a_real_twin_is_the_baseline_summed_in_another_order(shared_runs, tmp_path):
    """The twin of the checkpoint tests' cp=1 run, trained from its recorded config: every step
    logged, close to the baseline and not bit-identical; the cp=2 run of the same config then
    passes against it (as it does at rtol: 24 steps is short)."""
    from recipe.compare.noise import train_twin_process
    from recipe.launch.noise_twin import twin_config
    from tests.test_checkpoint import RUN

    source = shared_runs.run_dir(RUN)
    base = tmp_path / "base"
    base.mkdir()
    shutil.copytree(source / ".hydra", base / ".hydra")
    shutil.copy(source / "metrics.jsonl", base / "metrics.jsonl")
    cfg = twin_config(base)
    assert cfg.batching.sequence_order == "reversed" and cfg.trainer.checkpoint_every == 0
    assert cfg.output_dir == str(noise_twin_dir(base))
    twin = train_twin_process(base)
    floor = stored_floor(load_run(base), ["lm_loss", "grad_norm", "mtp_loss"])
    assert floor.twin == twin
    drift = max(floor.largest(m) for m in ("lm_loss", "grad_norm", "mtp_loss"))
    assert 0 < drift < RTOL
    cp2 = load_run(shared_runs.run_dir([*RUN, "cp=2"]))
    (result,) = [c for c in compare_all([load_run(base), cp2], RTOL) if c.baseline is not None]
    assert result.passed


def test_with_noise_floor_twin_the_jobs_a_report_will_judge_against_train_their_twin():
    from recipe.launch.noise_twin import is_sweep_baseline
    from tests.helpers.config import typed_config

    assert is_sweep_baseline(typed_config([]), 3), "auto: every reference-layout job"
    assert not is_sweep_baseline(typed_config(["cp=2"]), 0)
    assert not is_sweep_baseline(typed_config(["parallel.pp=2", "model.num_layers=2"]), 0)
    assert is_sweep_baseline(typed_config(["cp=2", "compare.baseline=1"]), 1), "the named job"
    assert not is_sweep_baseline(typed_config(["compare.baseline=1"]), 0)
