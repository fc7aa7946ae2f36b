"""The training mutation catalogue and the anchored check that keeps a long run's verdict able to
see a bug that starts late (docs/comparing-runs.md, docs/mutants.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hydra_plugins.recipe_launchers.catalogue_sweeper import (
    catalogue_job,
    fork_late_onsets,
    raise_correct_run_failures,
)
from recipe.compare.anchors import judge_anchor
from recipe.compare.runs import Run
from recipe.config import ConfigError, TrainConfig
from recipe.config.groups import CompareConfig, MutantConfig
from recipe.data.packing import pack_sequences
from recipe.names import MUTANTS
from recipe.parallel.cp.shard import shard_batch
from recipe.rundir.tokens import read_token_records, write_token_records
from recipe.training.mutants import CATALOGUE
from recipe.training.trainer import anchor_points
from tests.helpers.cli import run_train_cli
from tests.helpers.config import ROOT, typed_config
from tests.helpers.training import without_timings


def _anchor_side(path: Path, losses: dict[int, list[float]], metrics: dict[int, dict]) -> Run:
    for step, values in losses.items():
        rows = torch.tensor([[0, i, loss, 0, 0, 0] for i, loss in enumerate(values)],
                            dtype=torch.float64)  # fmt: skip
        write_token_records(path, step, [rows])
    return Run(path, [{"step": s, **m} for s, m in metrics.items()])


def test_an_anchor_judges_both_steps_metrics_and_the_first_steps_tokens(tmp_path):
    """The second step's tokens drift by up to the per-token tolerance in correct runs (Adam
    after one update from last-bit-different gradients), so they are not judged one by one; its
    metrics are, and every token of the first step."""
    losses = {101: [2.0, 3.0, 4.0], 102: [1.9, 2.9, 3.9]}
    metrics = {101: {"lm_loss": 3.0, "grad_norm": 1.0}, 102: {"lm_loss": 2.9, "grad_norm": 0.9}}
    baseline = _anchor_side(tmp_path / "base", losses, metrics)
    base_tokens = read_token_records(baseline.path)

    def judge(name, losses, metrics):
        probe = _anchor_side(tmp_path / name, losses, metrics)
        return judge_anchor(100, probe, baseline, base_tokens, 1e-5, 1e-5,
                            ("lm_loss", "grad_norm"), 1)  # fmt: skip

    same = judge("same", losses, metrics)
    assert same.passed and same.ratio == 0 and same.steps == [101, 102]
    second_token = judge("second_token", {**losses, 102: [1.9, 2.9 + 3e-5, 3.9]}, metrics)
    assert second_token.passed and second_token.token_max_abs == 0
    first_token = judge("first_token", {**losses, 101: [2.0, 3.0 + 3e-5, 4.0]}, metrics)
    assert not first_token.passed and first_token.ratio == pytest.approx(3, rel=1e-3)
    second_loss = {**metrics, 102: {"lm_loss": 2.9 * (1 + 3e-5), "grad_norm": 0.9}}
    second_metric = judge("second_metric", losses, second_loss)
    assert not second_metric.passed and second_metric.worst_metric == "lm_loss"
    assert second_metric.ratio == pytest.approx(3, rel=1e-3)


def test_anchor_points_every_n_steps_and_the_last_that_fits():
    assert anchor_points(500, 100, 2) == [100, 200, 300, 400, 498]
    assert anchor_points(24, 10, 2) == [10, 20, 22]
    assert anchor_points(100, 100, 2) == []  # a run no longer than anchor_every keeps none
    assert anchor_points(2000, 0, 2) == []


def test_the_catalogue_has_twenty_mutants_each_named_after_an_upstream_bug():
    assert set(CATALOGUE) == set(MUTANTS) - {"none"}
    assert len(CATALOGUE) >= 20
    for mutant in CATALOGUE.values():
        assert len(mutant.modelled_on) > 20, mutant.name
        hooks = [mutant.local, mutant.backward, mutant.model_call, mutant.mtp_counts]
        hooks += [mutant.unreduced, mutant.weights]
        assert sum(h is not None for h in hooks) == 1, mutant.name


def _packed(cp: int):
    sequences = [list(range(1, 1 + n)) for n in (13, 29, 7)]
    batch = pack_sequences(sequences, 2 * cp, pad_id=0)
    masks = torch.stack([batch.loss_mask, batch.loss_mask])
    return batch.replace(mtp_mask=masks)


LOCAL = [m for m in CATALOGUE.values() if m.local is not None]


@pytest.mark.parametrize("mutant", LOCAL, ids=lambda m: m.name)
@pytest.mark.parametrize("cp", [2, 4])
def test_each_sharding_mutant_breaks_the_local_batch_and_keeps_its_shapes(mutant, cp):
    batch = _packed(cp)
    changed = False
    for rank in range(cp):
        right = shard_batch(batch, cp, rank)
        broken = mutant.local(batch, right, cp, rank)
        for name, tensor in right.per_token().items():
            assert getattr(broken, name).shape == tensor.shape, name
            changed |= not torch.equal(getattr(broken, name), tensor)
    assert changed, f"{mutant.name} left every rank's micro-batch as it was"


GRADIENTS = [m for m in CATALOGUE.values() if m.unreduced is not None]


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vision"])
def test_each_gradients_mutant_leaves_out_parameters_the_model_has(vision):
    """A `gradients` mutant names parameters; one that names none of the model's trains as the
    correct path does, a silent no-op. The text model of the catalogue (MTP, learned positions)
    has them all; a vision model with MTP (its parameters under `language_model.`) has the MTP
    block and the norms, and no position table (mrope): mtp_grads_not_reduced named none of a
    vision model's parameters before its test read them under that prefix."""
    from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
    from recipe.parallel import groups
    from recipe.training.trainer import build_model
    from tests.test_vision import VISION

    text = ["mtp=on", "model.position_embedding_type=learned_absolute"]
    cfg = typed_config([*VISION, "mtp=on"] if vision else text)
    install_cpu_patches()
    with groups.parallel_world(cfg.parallel_dims):
        seed_model_parallel_rng(0)
        names = [name for name, _ in build_model(cfg, 64).named_parameters()]
    for mutant in GRADIENTS:
        has_table = not (vision and "position" in mutant.name)
        assert any(mutant.unreduced(n) for n in names) is has_table, mutant.name


def test_a_mutant_outside_the_catalogue_and_anchors_that_overlap_are_refused():
    with pytest.raises(ConfigError, match="mutant.name='typo' is not valid"):
        MutantConfig(name="typo")
    with pytest.raises(ConfigError, match="mutant.onset must be > 0"):
        MutantConfig(onset=0)
    with pytest.raises(ConfigError, match="anchor_steps=5 must be below"):
        CompareConfig(anchor_every=5, anchor_steps=5)
    assert TrainConfig().mutant.name == "none"


def test_the_catalogue_sweep_keeps_the_baseline_and_the_mutants_at_cp_above_one():
    assert catalogue_job(["cp='1'", "mutant.name=none", "mutant.onset=1"])
    assert not catalogue_job(["cp='1'", "mutant.name=rank_local_loss", "mutant.onset=1"])
    assert not catalogue_job(["cp='2'", "mutant.name=none", "mutant.onset=451"])
    assert catalogue_job(["cp='2'", "mutant.name=rank_local_loss", "mutant.onset=451"])


def test_a_late_mutant_resumes_from_its_cps_correct_run_at_the_step_before_its_onset():
    """Steps 1..K-1 of a mutant from onset K are its correct run's (the mutant is off): the
    sweep trains them once. (A forked run equals the run from scratch, every record of 40
    steps: measured with rank_local_loss from step 31, docs/mutants.md.)"""
    jobs = [
        ["cp='1'", "mutant.name=none", "mutant.onset=1"],
        ["cp='2'", "mutant.name=none", "mutant.onset=1"],
        ["cp='4'", "mutant.name=none", "mutant.onset=1"],
        ["cp='2'", "mutant.name=a", "mutant.onset=1"],
        ["cp='2'", "mutant.name=a", "mutant.onset=301"],
        ["cp='4'", "mutant.name=a", "mutant.onset=451"],
    ]
    forked = fork_late_onsets(jobs, Path("sweep"), 500)
    assert forked[0] == jobs[0], "cp=1 has no mutants: no checkpoints"
    # gcd(300, 450); 300, 450, 500 and one more (a preemption's checkpoint)
    kept = ["trainer.checkpoint_every=150", "trainer.checkpoint_keep=4"]
    assert forked[1] == [*jobs[1], *kept] and forked[2] == [*jobs[2], *kept]
    assert forked[3] == jobs[3], "onset 1 trains from the start"
    assert forked[4][-1] == "trainer.resume=sweep/1/checkpoints/step_00000300"
    assert forked[5][-1] == "trainer.resume=sweep/2/checkpoints/step_00000450"
    # a sweep of one late onset: the correct runs carry it too (the sweep's first onset)
    late_only = [[o.replace("onset=1", "onset=451") for o in job] for job in jobs[:3]]
    late_only.append(jobs[5])
    forked = fork_late_onsets(late_only, Path("sweep"), 500)
    assert [job[-1] for job in forked] == [
        "mutant.onset=451",
        "mutant.onset=451",
        "trainer.checkpoint_keep=3",
        "trainer.resume=sweep/2/checkpoints/step_00000450",
    ]
    # anything else swept beside cp: each mutant forks from the correct run of its own settings
    seeds = [[*job, f"trainer.seed={seed}"] for seed in (1, 2) for job in (jobs[1], jobs[4])]
    seeds = [seeds[0], seeds[2], seeds[1], seeds[3]]  # correct runs first, as launched
    assert [job[-1] for job in fork_late_onsets(seeds, Path("sweep"), 500)[2:]] == [
        "trainer.resume=sweep/0/checkpoints/step_00000300",
        "trainer.resume=sweep/1/checkpoints/step_00000300",
    ]
    given = [[*job, "trainer.max_steps=500"] for job in jobs]  # given, not swept: forks
    assert fork_late_onsets(given, Path("sweep"), 500)[4][-1].startswith("trainer.resume=")
    swept = [[*job, f"trainer.max_steps={500 + 100 * (i % 2)}"] for i, job in enumerate(jobs)]
    assert fork_late_onsets(swept, Path("sweep"), 500) == swept, "fork points would differ"
    alone = [["cp='2'", "mutant.name=a", "mutant.onset=451"]]  # no correct run to fork from
    assert fork_late_onsets(alone, Path("sweep"), 500) == alone
    assert fork_late_onsets(jobs[:4], Path("sweep"), 500) == jobs[:4], "no late onset"


def test_a_crashed_mutant_job_is_a_catch_and_a_crashed_correct_run_fails_the_sweep(tmp_path):
    """local_arange_positions indexes the learned position table past its end and its job
    crashes: the score counts it caught and the sweep goes on; a correct run's crash is raised."""
    import yaml
    from hydra.core.utils import JobReturn, JobStatus

    from recipe.compare.report import MUTATION_FILE, write_report
    from recipe.compare.runs import find_runs

    for name, cp, mutant in (
        ("0", 1, "none"),
        ("1", 2, "local_arange_positions"),
        ("2", 2, "none"),
    ):
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        config = {"cp": {"size": cp, "preprocess": "index"}, "parallel": {"dp": 1, "tp": 1},
                  "mutant": {"name": mutant, "onset": 1}, "output_dir": str(run)}  # fmt: skip
        (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        steps = 2 if mutant != "none" else 4  # the mutant's records end where it crashed
        rows = [{"step": s, "lm_loss": 5.0 / s, "grad_norm": 1.0} for s in range(1, steps + 1)]
        (run / "metrics.jsonl").write_text("".join(f"{r}\n".replace("'", '"') for r in rows))
    crash = [("1", "IndexError: index out of range in self")]
    _, passed = write_report(find_runs([tmp_path]), tmp_path, 1e-5, failures=crash)
    score = (tmp_path / MUTATION_FILE).read_text()
    assert "| 1 | local_arange_positions | 2 | 1 | job failed | IndexError" in score
    assert score.strip().splitlines()[-1] == "training mutation score: 1/1 caught"
    assert "| 2 | none | 2 | 1 |" in score and "PASS (correct run)" in score

    mutant, correct = ["mutant.name=local_arange_positions", "cp=2"], ["mutant.name=none", "cp=2"]
    failed = JobReturn(status=JobStatus.FAILED, _return_value=IndexError("past the table"))
    done = JobReturn(status=JobStatus.COMPLETED, _return_value=None)
    raise_correct_run_failures([mutant, correct], [failed, done])  # the sweep goes on
    with pytest.raises(IndexError, match="past the table"):
        raise_correct_run_failures([correct], [failed])


@pytest.mark.launches
def test_a_bug_that_starts_late_fails_at_an_anchor_however_wide_the_floor(tmp_path):
    """A 24-step catalogue slice whose floor is widened a million times (as a long run's is):
    the curves cannot see rank_local_loss from step 21, the anchor at step 20 does; the correct
    cp=2 run passes every anchor. Without the baseline's anchors the same run PASSES: the
    anchors are what catch it."""
    sweep = tmp_path / "sweep"
    done = run_train_cli(
        [
            "experiment=training_mutants",
            "mutant.name=none,rank_local_loss",
            "cp='1','2'",
            "mutant.onset=21",
            "trainer.max_steps=24",
            "compare.anchor_every=10",
            "compare.noise_margin=1e6",
            f"hydra.sweep.dir={sweep}",
            "-m",  # after the overrides: argparse cannot interleave it with them
        ],
        cwd=tmp_path,
        timeout=600,
    )
    score = (sweep / "mutation_report.md").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert score.strip().splitlines()[-1] == "training mutation score: 1/1 caught"
    assert "training mutation score (every mutant caught)" in done.stdout
    assert "parity report (every mutant caught)" in done.stdout  # not "all PASS": a FAIL is in it
    assert "| rank_local_loss | 2 | 21 | anchor 20 (grad_norm) |" in score
    assert "PASS (correct run)" in score
    report = (sweep / "parity_report.md").read_text()
    assert "| 0 | 20 | 21-22 |" not in report  # the baseline is not judged against itself
    rows = [line for line in report.splitlines() if line.startswith("| 1: ")]
    assert len(rows) == 1 + 3 and all("PASS" in r for r in rows), rows  # its 3 anchors pass
    # the mutant resumed from the correct cp=2 run at step 20: its first 20 records are those
    mutant = next(
        job for job in sweep.iterdir()
        if "mutant.name=rank_local_loss" in ((job / ".hydra" / "overrides.yaml").read_text()
                                            if (job / ".hydra").is_dir() else "")
    )  # fmt: skip
    overrides = (mutant / ".hydra" / "overrides.yaml").read_text()
    assert f"trainer.resume={sweep / '1' / 'checkpoints' / 'step_00000020'}" in overrides
    from recipe.rundir.metrics import read_metrics

    first = without_timings(read_metrics(sweep / "1"))
    forked = without_timings(read_metrics(mutant))
    assert forked[:20] == first[:20] and forked[20] != first[20]

    # the negative control: the same run, judged without the baseline's anchors
    import shutil

    shutil.rmtree(sweep / "0" / "anchors")
    shutil.rmtree(mutant / "anchor_probes")
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.compare",
            str(mutant),
            "--baseline",
            str(sweep / "0"),
            "--noise-margin",
            "1e6",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout
    assert "no anchored check: the baseline 0 kept no anchors" in again.stdout
