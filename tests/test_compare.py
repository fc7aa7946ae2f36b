"""The run comparison behind parity reports and scripts/compare_runs.py, on synthetic runs, plus a
real (tiny) multirun sweep that must end in a report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.compare.diff import all_passed, compare_all
from recipe.compare.report import render_markdown
from recipe.compare.runs import find_runs, load_run, run_labels
from tests.helpers.fake_runs import make_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compare_runs.py"


def test_identical_and_tiny_differences_pass_large_ones_fail(tmp_path):
    make_run(tmp_path, "0", cp=1)
    make_run(tmp_path, "1", cp=2, shift=1e-8)
    make_run(tmp_path, "2", cp=4, shift=1e-3)
    results = compare_all(find_runs([tmp_path]), rtol=1e-5)
    assert [c.passed for c in results] == [None, True, False]
    assert results[2].diffs[0].metric == "lm_loss"
    # Largest at the last step: 5/5 = 1.0 against 1.0 + 5 * 1e-3.
    assert results[2].diffs[0].max_rel == pytest.approx(5e-3 / 1.005, rel=1e-9)
    assert not all_passed(results)


def test_a_sweep_directory_yields_its_jobs_not_their_twins_or_anchor_probes(tmp_path):
    """`python -m recipe.compare SWEEP` on a sweep whose baseline has a noise twin and whose
    runs have anchor probes: the jobs only, labelled by what differs between them."""
    make_run(tmp_path, "0", cp=1)
    make_run(tmp_path, "1", cp=2)
    make_run(tmp_path / "0", "noise_twin", cp=1)
    (tmp_path / "1" / "anchor_probes").mkdir()
    (tmp_path / "1" / "anchor_probes" / "step_00000100" / "metrics.jsonl").parent.mkdir()
    (tmp_path / "1" / "anchor_probes" / "step_00000100" / "metrics.jsonl").write_text(
        json.dumps({"step": 101, "lm_loss": 1.0}) + "\n"
    )
    runs = find_runs([tmp_path])
    assert [r.path.name for r in runs] == ["0", "1"]
    assert run_labels(runs) == {tmp_path / "0": "0: cp=1", tmp_path / "1": "1: cp=2"}


def test_baseline_is_cp1_with_otherwise_the_same_settings(tmp_path):
    make_run(tmp_path, "0", cp=1, pe="rope")
    make_run(tmp_path, "1", cp=1, pe="learned_absolute", shift=0.5)
    make_run(tmp_path, "2", cp=2, pe="learned_absolute", shift=0.5)
    make_run(tmp_path, "3", cp=2, pe="rope")
    results = compare_all(find_runs([tmp_path]), rtol=1e-5)
    assert [c.baseline.path.name if c.baseline else None for c in results] == [None, None, "1", "0"]
    assert all_passed(results)


def test_explicit_baseline_and_runs_without_one(tmp_path):
    make_run(tmp_path, "a", cp=2, pe="learned_absolute")
    make_run(tmp_path, "b", cp=2, pe="rope")
    runs = find_runs([tmp_path])
    assert [c.passed for c in compare_all(runs, 1e-5)] == [None, None]
    report = render_markdown(compare_all(runs, 1e-5), 1e-5)
    assert "no baseline" in report
    forced = compare_all(runs, 1e-5, baseline=load_run(tmp_path / "a"))
    assert [c.passed for c in forced] == [None, True]


def test_unequal_lengths_are_reported_not_crashed_on(tmp_path):
    make_run(tmp_path, "0", cp=1, steps=10)
    make_run(tmp_path, "1", cp=2, steps=6)
    (base, short) = compare_all(find_runs([tmp_path]), 1e-5)
    assert short.passed is False and short.steps_compared == 6
    assert "logged 6 steps, baseline 10" in short.notes[0]
    assert "logged 6 steps, baseline 10" in render_markdown([base, short], 1e-5)


def test_missing_metrics_are_reported_not_crashed_on(tmp_path):
    make_run(tmp_path, "0", cp=1, mtp=True)
    make_run(tmp_path, "1", cp=2, mtp=True, drop=("mtp_loss",))
    make_run(tmp_path, "2", cp=2, mtp=True, drop=("grad_norm",))
    results = compare_all(find_runs([tmp_path]), 1e-5)
    assert [c.passed for c in results] == [None, False, False]
    report = render_markdown(results, 1e-5)
    assert "missing in run" in report and "mtp_loss is missing in the run" in report
    # A metric neither side logged is simply not compared.
    make_run(tmp_path / "x", "0", cp=1)
    make_run(tmp_path / "x", "1", cp=2)
    assert all_passed(compare_all(find_runs([tmp_path / "x"]), 1e-5))


@pytest.mark.launches
def test_compare_runs_script_exit_codes(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_run(good, "0", cp=1)
    make_run(good, "1", cp=2, shift=1e-9)
    make_run(bad, "0", cp=1)
    make_run(bad, "1", cp=2, shift=1e-2)

    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    ok = run(good / "0", good / "1", "--plot", tmp_path / "p.png")
    assert ok.returncode == 0, ok.stderr
    assert "**PASS**" in ok.stdout and (tmp_path / "p.png").stat().st_size > 10_000
    failing = run(bad / "1", "--baseline", bad / "0")
    assert failing.returncode == 1 and "**FAIL**" in failing.stdout
    assert run(bad / "1", "--rtol", "0.5", "--baseline", bad / "0").returncode == 0
    assert run(tmp_path / "nowhere").returncode == 2
    nothing = run(good / "1")  # a cp=2 run alone has no baseline
    assert nothing.returncode == 1 and "nothing was compared" in nothing.stderr
    as_module = subprocess.run(
        [sys.executable, "-m", "recipe.compare", str(bad / "1"), "--baseline", str(bad / "0")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (as_module.returncode, as_module.stdout) == (failing.returncode, failing.stdout)


@pytest.mark.distributed
def test_a_multirun_sweep_ends_in_a_parity_report(tmp_path):
    from tests.helpers.cli import run_train_cli

    sweep = tmp_path / "sweep"
    result = run_train_cli(
        [
            "trainer.max_steps=3",
            "cp=1,2",
            "model.position_embedding_type=rope,learned_absolute",
            f"hydra.sweep.dir={sweep}",
            "-m",  # after the overrides: argparse cannot interleave it with them
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    job_dirs = sorted(p.parent.name for p in sweep.rglob("metrics.jsonl"))
    assert job_dirs == ["0", "1", "2", "3"], "one directory per job"
    report = (sweep / "parity_report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.rsplit("|", 2)[1].strip() for r in rows[1:]] == [
        "baseline",
        "baseline",
        "**PASS**",
        "**PASS**",
    ]
    assert "2 passed, 0 failed" in report
    assert (sweep / "loss_curves.png").stat().st_size > 10_000


def test_the_first_plot_on_a_fresh_machine_lists_its_fonts_in_a_fast_test():
    """A fresh machine has no matplotlib font cache: the first plot builds it, asking fontconfig
    (`fc-list`, a quick tool) for the system's fonts. The sweep's report plots in tests that
    start no process, which must allow that (on a fresh clone, six of them failed here)."""
    from matplotlib import font_manager

    font_manager._get_fontconfig_fonts.cache_clear()  # as in a process that has not asked yet
    assert font_manager.FontManager().ttflist, "matplotlib's own fonts at least"


def test_failed_jobs_and_truncated_metrics_are_reported(tmp_path):
    from recipe.compare.report import write_report

    make_run(tmp_path, "0", cp=1)
    partial = make_run(tmp_path, "1", cp=2, steps=5)
    with open(partial / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lm_lo')  # killed mid-write
    runs = find_runs([tmp_path])
    report, passed = write_report(runs, tmp_path, 1e-5, failures=[("2", "RanksFailed: boom")])
    assert not passed
    assert "ignored a line cut short by a kill (6)" in report
    assert "| 2 | - |" in report and "**FAIL** (job failed)" in report
    assert "job 2 failed: RanksFailed: boom" in report
    assert "1 passed, 1 failed" in report


@pytest.mark.launches
def test_baseline_given_by_another_spelling_of_its_path(tmp_path, monkeypatch):
    make_run(tmp_path, "a", cp=1)
    make_run(tmp_path, "b", cp=2)
    monkeypatch.chdir(tmp_path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "a", "b", "--baseline", str(tmp_path / "a")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0
    assert "1 passed, 0 failed" in result.stdout, "the baseline is not compared with itself"


# --- the sweep callback: reports only for sweeps, only in the sweep directory -------------------


def _hydra_config(tmp_path: Path, run_dir: Path, **compare):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "compare": {"rtol": 1e-5, "baseline": "auto", "fail_exit_code": True, **compare},
            "hydra": {
                "runtime": {"output_dir": str(run_dir)},
                "job": {"num": int(run_dir.name) if run_dir.name.isdigit() else 0},
                "sweep": {"dir": str(tmp_path), "params": {"cp": "1,2"}},
                "overrides": {"task": ["trainer.max_steps=3"]},
            },
        }
    )


def _job_return(failed: bool):
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn()
    ret.status = JobStatus.FAILED if failed else JobStatus.COMPLETED
    ret._return_value = RuntimeError("boom") if failed else 1.0
    return ret


def test_a_single_run_that_fails_writes_no_report_anywhere(tmp_path):
    """A failed single run (or a torchrun rank) used to write a FAIL-only report into the
    parent of its run directory, over a real sweep's report."""
    from recipe.compare.sweep import ParityReportCallback

    run = make_run(tmp_path, "run", cp=2)
    (tmp_path / "parity_report.md").write_text("a real sweep's PASS report\n")
    ParityReportCallback().on_job_end(_hydra_config(tmp_path, run), _job_return(failed=True))
    assert (tmp_path / "parity_report.md").read_text() == "a real sweep's PASS report\n"
    assert not (tmp_path / "loss_curves.png").exists()


def test_a_sweep_that_fails_parity_exits_1_and_leaves_no_stale_report(tmp_path):
    from recipe.compare.sweep import ParityReportCallback

    (tmp_path / "parity_report.md").write_text("an older sweep's PASS report\n")
    callback = ParityReportCallback()
    callback.on_multirun_start(_hydra_config(tmp_path, tmp_path))
    assert not (tmp_path / "parity_report.md").exists(), "removed before the first job"
    for name, cp, shift in (("0", 1, 0.0), ("1", 2, 0.5)):
        run = make_run(tmp_path, name, cp=cp, shift=shift)
        callback.on_job_end(_hydra_config(tmp_path, run), _job_return(failed=False))
    with pytest.raises(SystemExit) as exit_info:
        callback.on_multirun_end(_hydra_config(tmp_path, tmp_path))
    assert exit_info.value.code == 1
    assert "0 passed, 1 failed" in (tmp_path / "parity_report.md").read_text()
    quiet = ParityReportCallback()
    quiet.on_multirun_start(_hydra_config(tmp_path, tmp_path, fail_exit_code=False))
    for name in ("0", "1"):
        quiet.on_job_end(_hydra_config(tmp_path, tmp_path / name), _job_return(failed=False))
    quiet.on_multirun_end(_hydra_config(tmp_path, tmp_path))  # reports FAIL, exits 0
    assert "0 passed, 1 failed" in (tmp_path / "parity_report.md").read_text()


@pytest.mark.launches
def test_a_bad_compare_baseline_stops_the_sweep_before_any_job(tmp_path):
    from tests.helpers.cli import run_train_cli

    sweep = tmp_path / "sweep"
    result = run_train_cli(
        ["cp=1,2", "compare.baseline=5", f"hydra.sweep.dir={sweep}", "-m"], cwd=tmp_path
    )
    assert result.returncode == 2
    assert "config error: compare.baseline=5 is not a job of this sweep: it runs 2 jobs" in (
        result.stderr + result.stdout
    )
    assert not list(sweep.rglob("metrics.jsonl")), "no job ran"


@pytest.mark.launches
def test_a_failed_job_does_not_stop_the_sweep_which_then_exits_1(tmp_path):
    """docs/faults.md said a failed job stops the sweep; Hydra's basic launcher runs the rest and
    raises the first failure only at the end. Both jobs fail at start-up here (hidden sizes the
    tiny model's 4 heads do not divide), so no job trains."""
    import json

    from tests.helpers.cli import run_train_cli

    sweep = tmp_path / "sweep"
    result = run_train_cli(
        ["model.hidden_size=33,34", f"hydra.sweep.dir={sweep}", "-m"], cwd=tmp_path, timeout=120
    )
    assert result.returncode == 1, result.stderr[-2000:]
    ended = [json.loads((sweep / ".jobs" / f"{n}.json").read_text()) for n in (0, 1)]
    assert [e["error"].split(" is not")[0] for e in ended] == [
        "model.hidden_size=33",
        "model.hidden_size=34",
    ], "the second job ran after the first failed"
    report = (sweep / "parity_report.md").read_text()
    assert "job 0 failed: model.hidden_size=33" in report
    assert "job 1 failed: model.hidden_size=34" in report
    assert "ConfigError: model.hidden_size=33 is not divisible" in result.stderr, "the first"


def _token_records(run: Path, losses: list[float]) -> None:
    import torch

    from recipe.rundir.tokens import write_token_records

    rows = torch.tensor(
        [[0, i, loss, 0, 0, 0] for i, loss in enumerate(losses)], dtype=torch.float64
    )
    write_token_records(run, 1, [rows])


def test_reports_say_how_far_a_failing_run_missed_and_check_tokens_when_recorded(tmp_path):
    from recipe.compare.report import write_report

    base = make_run(tmp_path, "0", cp=1)
    good = make_run(tmp_path, "1", cp=2)
    bad = make_run(tmp_path, "2", cp=2, shift=1e-3)
    _token_records(base, [1.0, 2.0, 3.0])
    _token_records(good, [1.0, 2.0, 3.0])
    _token_records(bad, [1.0, 2.0, 3.5])
    report, passed = write_report(find_runs([tmp_path]), tmp_path, 1e-5)
    assert not passed
    worst_rel = max(abs(5.0 / s + 1e-3 * s - 5.0 / s) / (5.0 / s + 1e-3 * s) for s in range(1, 6))
    missed = f"lm_loss {worst_rel / 1e-5:.3g}x (step 5) the tolerance; {0.5 / 1e-5:.3g}x atol"
    assert missed in report
    assert "## Per-token parity" in report and report.count("### Per-token") == 2


def test_a_token_mismatch_alone_fails_the_sweep(tmp_path):
    from recipe.compare.report import write_report

    base, run = make_run(tmp_path, "0", cp=1), make_run(tmp_path, "1", cp=2)
    _token_records(base, [1.0, 2.0])
    _token_records(run, [1.0, 2.1])
    report, passed = write_report(find_runs([tmp_path]), tmp_path, 1e-5)
    assert "1 passed, 0 failed" in report, "the curves agree"
    assert not passed, "the tokens do not"


def test_a_golden_file_round_trips_and_a_perturbed_curve_fails(tmp_path, capsys):
    from recipe.compare.__main__ import main

    base = make_run(tmp_path / "a", "base", cp=1)
    _token_records(base, [1.0, 2.0, 3.0])
    golden = tmp_path / "cp1.golden.json"
    assert main([str(base), "--export-golden", str(golden)]) == 0
    same = make_run(tmp_path / "b", "same", cp=2)
    _token_records(same, [1.0, 2.0, 3.0])
    assert main([str(same), "--golden", str(golden), "--per-token"]) == 0
    perturbed = make_run(tmp_path / "c", "perturbed", cp=2, shift=1e-4)
    assert main([str(perturbed), "--golden", str(golden)]) == 1
    tokens_off = make_run(tmp_path / "d", "tokens_off", cp=2)
    _token_records(tokens_off, [1.0, 2.0, 3.001])
    assert main([str(tokens_off), "--golden", str(golden)]) == 0, "curves alone pass"
    assert main([str(tokens_off), "--golden", str(golden), "--per-token"]) == 1
    capsys.readouterr()
    assert main([str(same), "--golden", str(tmp_path / "nope.json")]) == 2
    assert "cannot read golden file" in capsys.readouterr().err
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--export-golden", "x.json"]) == 2


def test_the_report_notes_runs_with_spikes_and_which_were_not_applied(tmp_path):
    make_run(tmp_path, "0", cp=1)
    spiky = make_run(tmp_path, "1", cp=2)
    rows = [json.loads(line) for line in (spiky / "metrics.jsonl").read_text().splitlines()]
    rows[2]["spike"] = {"lm_loss": 3.2}
    rows[3].update(spike={"grad_norm": 7.0}, skipped=True)
    (spiky / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = render_markdown(compare_all(find_runs([tmp_path]), 1e-5), 1e-5)
    assert "2 spike step(s) flagged by the step guard (steps 3, 4, not applied: 4)" in report
    quiet = render_markdown(compare_all(find_runs([tmp_path / "0"]), 1e-5), 1e-5)
    assert "spike" not in quiet


def test_non_finite_steps_are_reported_and_never_pass(tmp_path):
    """A NaN/inf is written as null; the comparison says at which steps and fails, instead of
    comparing the other steps only and showing an earlier step's value as final."""
    make_run(tmp_path, "0", cp=1)
    broken = make_run(tmp_path, "1", cp=2)
    rows = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    for row in rows[3:]:
        row["lm_loss"] = None
    (broken / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    comparisons = compare_all(find_runs([tmp_path]), 1e-5)
    assert not all_passed(comparisons)
    assert "lm_loss is non-finite in the run at 2 steps (4, 5)" in comparisons[1].notes
    report = render_markdown(comparisons, 1e-5)
    assert "non-finite in the run at 2 steps" in report and "0 passed, 1 failed" in report


def test_a_failed_job_that_logged_every_step_is_not_shown_as_pass(tmp_path):
    """It failed after its last record (writing its summary, say): its curve matches, and it
    is still FAIL, counted once."""
    make_run(tmp_path, "0", cp=1)
    make_run(tmp_path, "1", cp=2)
    make_run(tmp_path, "2", cp=2, pe="rope")
    comparisons = compare_all(find_runs([tmp_path]), 1e-5)
    assert [c.passed for c in comparisons] == [None, True, True], "the curves match"
    report = render_markdown(comparisons, 1e-5, failures=[("1", "OSError: disk full")])
    (row,) = [line for line in report.splitlines() if line.startswith("| 1")]
    assert row.endswith("**FAIL** (job failed) |")
    assert "1 passed, 1 failed" in report
    baseline_failed = render_markdown(comparisons, 1e-5, failures=[("0", "boom")])
    assert "baseline (job failed)" in baseline_failed and "2 passed, 1 failed" in baseline_failed


def test_a_directory_of_numbered_and_named_runs_is_ordered_not_crashed_on(tmp_path):
    for name in ("10", "cp4", "2", "0"):
        make_run(tmp_path, name, cp=1)
    assert [r.path.name for r in find_runs([tmp_path])] == ["0", "2", "10", "cp4"]
