"""Checkpoints and resume: killed runs continue bit for bit, and any layout resumes any other's.

The end-to-end tests run `train.py` as a user would and kill it with SIGKILL (the whole job:
self-launch parent and ranks) at whatever step it has reached, then resume with
`trainer.resume=auto`. Same layout: every logged value equals the uninterrupted run's exactly.
Another layout: within the parity tolerance, with a negative control (a checkpoint whose data
position is wrong) that must fail the same comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe import checkpoint as ckpt
from recipe.checkpoint import fs
from recipe.compare.diff import compare
from recipe.compare.runs import load_run
from recipe.data.fingerprint import fingerprint_changes, sha256
from recipe.errors import ConfigError
from recipe.rundir.layout import MANIFEST_FILE, PARTIAL_SUFFIX, SET_ASIDE_DIR
from recipe.rundir.metrics import (
    OutputWriteError,
    effective_records,
    parse_metrics_lines,
    read_metrics,
    run_id_in,
)
from recipe.training.loggers import RunLogger
from tests.helpers.cli import (
    run_train_cli,
    signal_after_steps,
    start_train_cli,
    wait_for_steps,
)
from tests.helpers.config import typed_config
from tests.helpers.training import without_timings

# 24 steps, a checkpoint every 8 (all kept), MTP on: the tiny run takes about 0.1 s a step, so a
# test that waits for step 10 and kills finds the job between two checkpoints.
RUN = [
    "trainer.max_steps=24",
    "trainer.checkpoint_every=8",
    "trainer.checkpoint_keep=3",
    "mtp=on",
]
RTOL = 1e-5  # compare.rtol's default: the parity tolerance for fp32 on CPU


def _train(run_dir: Path, *args: str) -> list[dict]:
    done = run_train_cli([*RUN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(run_dir)


def _kill_during_training(run_dir: Path, after_steps: int, *args: str) -> int:
    """Start a run, SIGKILL the whole job once it logged `after_steps` steps; returns the steps
    it had logged when it died."""
    job = start_train_cli([*RUN, *args], run_dir)
    try:
        wait_for_steps(job, run_dir, after_steps)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    logged = read_metrics(run_dir)
    assert len(logged) < 24, "the job finished before the kill: nothing was interrupted"
    return len(logged)


# The uninterrupted runs every resume is compared with, trained in process (cp=1) and in the
# session's world of two (cp=2), with the run directory `train.py` would leave: what is tested
# against them is the resumed CLI run, and train() computes the same numbers either way.
@pytest.fixture(scope="module")
def reference_cp1(shared_runs) -> Path:
    return shared_runs.run_dir(RUN)


@pytest.fixture(scope="module")
def reference_cp2(shared_runs) -> Path:
    return shared_runs.run_dir([*RUN, "cp=2"])


def _resume_in_process(shared_runs, *args: str) -> Path:
    """A resume whose CLI is not what is tested (another layout, a doctored checkpoint): trained
    in process or in the session's worlds, into a run directory of its own."""
    return shared_runs.run_dir([*RUN, *args])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param([], id="cp1"),
        # on the legacy stack the cp=2 kill covers the same checkpoint and resume path, its CP
        # shards added: cp=1 runs on the current stack only (CI time, docs/testing.md)
        pytest.param(["cp=2"], id="cp2", marks=pytest.mark.stack_dependent),
    ],
)
def test_a_killed_run_resumes_bit_for_bit(layout, tmp_path, reference_cp1, reference_cp2):
    reference = reference_cp2 if layout else reference_cp1
    run_dir = tmp_path / "run"
    killed_at = _kill_during_training(run_dir, 10, *layout)
    assert killed_at > 8, "killed past the step-8 checkpoint"
    _train(run_dir, *layout, "trainer.resume=auto")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) > 24, "the killed run's lines are kept, not truncated"
    (marker,) = [json.loads(line)["resumed"] for line in lines if '"resumed"' in line]
    assert marker["from_step"] in (8, 16) and marker["from_step"] <= killed_at
    assert without_timings(read_metrics(run_dir)) == without_timings(read_metrics(reference))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24


@pytest.mark.stack_dependent
@pytest.mark.distributed
def test_a_cp2_checkpoint_resumes_at_cp1_within_the_parity_tolerance(
    shared_runs, reference_cp1, reference_cp2
):
    start = reference_cp2 / "checkpoints" / "step_00000008"
    resumed = _resume_in_process(shared_runs, f"trainer.resume={start}")
    result = compare(load_run(resumed), load_run(reference_cp1), RTOL)
    assert result.passed, [(d.metric, d.max_rel) for d in result.diffs]
    assert result.steps_compared == 24
    cp2_head = read_metrics(reference_cp2)[:8]
    before = without_timings(read_metrics(resumed)[:8])
    assert before == without_timings(cp2_head), "the curve before the resume"


@pytest.mark.distributed
def test_sigterm_checkpoints_at_the_step_boundary_and_tp_resumes_both_ways(tmp_path, reference_cp1):
    """cp1 -> tp2 (each rank slices its shard), SIGTERM at tp2 (the ranks join their shards into
    the checkpoint), tp2 -> cp1: the curve stays within the tolerance of the uninterrupted one."""
    run_dir = tmp_path / "run"
    start = reference_cp1 / "checkpoints" / "step_00000008"
    job = start_train_cli([*RUN, "parallel.tp=2", f"trainer.resume={start}"], run_dir)
    stderr = signal_after_steps(job, run_dir, 10, signal.SIGTERM)
    assert job.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    newest = ckpt.complete_checkpoints(run_dir / "checkpoints")[-1]
    stopped_at = len(read_metrics(run_dir))
    assert newest[0] == stopped_at, "the checkpoint is of the last step taken"
    assert 8 < stopped_at < 24
    assert f"newest checkpoint {newest[1]}; continue with trainer.resume=auto" in stderr
    assert ckpt.read_manifest(newest[1])["layout"] == {"tp": 2, "cp": 1, "dp": 1, "pp": 1}
    _train(run_dir, "trainer.resume=auto")
    result = compare(load_run(run_dir), load_run(reference_cp1), RTOL)
    assert result.passed, [(d.metric, d.max_rel) for d in result.diffs]
    assert result.steps_compared == 24


@pytest.mark.distributed
def test_a_cp1_checkpoint_resumes_at_dp2_x_cp2_within_the_parity_tolerance(
    shared_runs, reference_cp1
):
    start = reference_cp1 / "checkpoints" / "step_00000016"
    resumed = _resume_in_process(shared_runs, f"trainer.resume={start}", "cp=2", "parallel.dp=2")
    result = compare(load_run(resumed), load_run(reference_cp1), RTOL)
    assert result.passed, [(d.metric, d.max_rel) for d in result.diffs]
    assert ckpt.read_manifest(resumed / "checkpoints" / "step_00000024")["layout"] == {
        "tp": 1,
        "cp": 2,
        "dp": 2,
        "pp": 1,
    }


def test_negative_control_a_wrong_data_position_fails_the_same_comparison(
    tmp_path, shared_runs, reference_cp1
):
    """The within-tolerance checks above prove something only if a resume that restores the
    wrong state fails them: here the data stream restarts from the top."""
    bad = tmp_path / "bad_checkpoint"
    shutil.copytree(reference_cp1 / "checkpoints" / "step_00000008", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["data"] = {"epoch": 0, "position": 0}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    resumed = _resume_in_process(shared_runs, f"trainer.resume={bad}")
    result = compare(load_run(resumed), load_run(reference_cp1), RTOL)
    assert result.passed is False
    assert max(d.max_rel for d in result.diffs if d.metric == "lm_loss") > 100 * RTOL


@pytest.mark.launches
def test_resume_refuses_another_model_and_names_what_differs(tmp_path, reference_cp1):
    done = run_train_cli(
        [*RUN, f"trainer.resume={reference_cp1}", "model.hidden_size=64"]
        + [f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "written by a different model or data stream: model.hidden_size: 32 -> 64" in (
        done.stderr
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "refused before training"


@pytest.mark.launches
def test_sigusr1_checkpoints_and_requeues_the_slurm_job(tmp_path):
    """SLURM's warning before a time limit (sbatch --signal=USR1@90): checkpoint, ask SLURM to
    run the job again, exit 128 + 10."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    job = start_train_cli(
        ["trainer.max_steps=2000", "trainer.requeue=true"],
        run_dir,
        env_extra={"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    stderr = signal_after_steps(job, run_dir, 3, signal.SIGUSR1)
    assert job.returncode == 138, stderr[-3000:]
    assert "stopped by SIGUSR1 after step" in stderr and "requeued SLURM job 4242" in stderr
    assert calls.read_text().split() == ["requeue", "4242"]
    assert ckpt.complete_checkpoints(run_dir / "checkpoints")[-1][0] == len(read_metrics(run_dir))


@pytest.mark.launches
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE stands in for a full disk")
def test_a_checkpoint_that_cannot_be_written_names_the_path_and_keeps_no_half(tmp_path):
    """A full disk gave an ENOSPC traceback without a path. RLIMIT_FSIZE makes every file larger
    than 64 KiB fail to grow (EFBIG), as a full disk would: the checkpoint's tensors do not fit,
    the config and metrics do."""
    import resource

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write instead of the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    run_dir = tmp_path / "run"
    job = start_train_cli(["trainer.checkpoint_every=2"], run_dir, preexec_fn=small_files)
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 1, stderr[-3000:]
    partial = run_dir / "checkpoints" / "step_00000002.partial"
    assert f"could not write checkpoint {partial}: " in stderr
    assert "File too large" in stderr
    assert ckpt.complete_checkpoints(run_dir / "checkpoints") == []
    assert ckpt.resolve_resume("auto", run_dir) is None
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


# --- the pieces -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim_seed=st.integers(0, 2),
    tp=st.sampled_from([1, 2, 4]),
)
def test_tp_shards_rejoin_to_the_full_tensor(shape, dim_seed, tp):
    dim = dim_seed % len(shape)
    shape[dim] *= tp
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    shards = [ckpt.tp_shard(full, dim, rank, tp) for rank in range(tp)]
    assert torch.equal(torch.cat(shards, dim=dim), full)
    # megatron's own rule for a shard: rows [rank * n / tp, (rank + 1) * n / tp) of that dim
    size = shape[dim] // tp
    for rank, shard in enumerate(shards):
        index = torch.arange(rank * size, (rank + 1) * size)
        assert torch.equal(shard, full.index_select(dim, index))


def test_a_dimension_that_does_not_split_is_an_error():
    with pytest.raises(ValueError, match="does not split into 2"):
        ckpt.tp_shard(torch.zeros(3, 4), 0, 0, 2)


def _fake_checkpoint(directory: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint that verifies: a stand-in shard, listed in the manifest with its size and
    checksum (a manifest listing nothing, beside no DCP .metadata, is damaged: nothing to load)."""
    path = directory / ckpt.checkpoint_name(step)
    if not complete:
        path = path.with_name(path.name + PARTIAL_SUFFIX)
    path.mkdir(parents=True)
    shard = path / "__0_0.distcp"
    shard.write_bytes(f"the tensors of step {step}".encode())
    if complete:
        files = {shard.name: {"size": shard.stat().st_size, "sha256": sha256(shard)}}
        (path / MANIFEST_FILE).write_text(json.dumps({"format": 1, "step": step, "files": files}))
    return path


def test_resume_finds_the_newest_complete_checkpoint_and_never_a_partial(tmp_path):
    run = tmp_path / "run"
    assert ckpt.resolve_resume(None, run) is None
    assert ckpt.resolve_resume("auto", run) is None, "auto starts fresh in a new directory"
    checkpoints = run / "checkpoints"
    _fake_checkpoint(checkpoints, 8)
    newest = _fake_checkpoint(checkpoints, 16)
    partial = _fake_checkpoint(checkpoints, 24, complete=False)
    (checkpoints / "step_00000030").mkdir()  # no manifest: damaged, passed over with a warning
    assert ckpt.resolve_resume("auto", run) == newest
    assert ckpt.resolve_resume(str(run), None) == newest
    assert ckpt.resolve_resume(str(checkpoints), None) == newest
    assert ckpt.resolve_resume(str(checkpoints / "step_00000008"), None).name == "step_00000008"
    with pytest.raises(ConfigError, match="never completed"):
        ckpt.resolve_resume(str(partial), None)
    with pytest.raises(ConfigError, match="does not exist"):
        ckpt.resolve_resume(str(tmp_path / "nowhere"), None)
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        ckpt.resolve_resume(str(tmp_path), None)


def test_pruning_keeps_the_newest_and_removes_partials(tmp_path):
    for step in (4, 8, 12, 16):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 20, complete=False)
    finished = _fake_checkpoint(tmp_path, 24, complete=False)
    (finished / MANIFEST_FILE).write_text(json.dumps({"format": 1, "step": 24}))
    ckpt.prune_checkpoints(tmp_path, keep=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [12, 16]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000012",
        "step_00000016",
        "step_00000024.partial",  # a finished write never renamed: the user's to rename
    ]


@pytest.mark.parametrize("contents", ["shards", "metadata", "empty"])
def test_a_step_directory_without_its_manifest_is_damaged_never_a_fresh_start(
    contents, tmp_path, caplog
):
    """Every way a `step_N` directory can lack its manifest (removed, a copy cut short, an empty
    directory) counts as a damaged checkpoint: auto refuses to start over in its directory."""
    run = tmp_path / "run"
    lost = run / "checkpoints" / ckpt.checkpoint_name(30)
    lost.mkdir(parents=True)
    if contents == "shards":
        (lost / "__0_0.distcp").write_bytes(b"shard")
    elif contents == "metadata":
        (lost / ".metadata").write_bytes(b"meta")
    problem = ckpt.checkpoint_problem(lost)
    assert f"{lost / MANIFEST_FILE} is missing" in problem
    assert ("empty" in problem) == (contents == "empty")
    with caplog.at_level("WARNING"), pytest.raises(ConfigError, match="every checkpoint in"):
        ckpt.resolve_resume("auto", run)
    assert f"skipping damaged checkpoint {lost}" in caplog.text
    with pytest.raises(ConfigError, match=rf"trainer.resume={lost} is damaged: .* is missing"):
        ckpt.resolve_resume(str(lost), None)
    older = _fake_checkpoint(run / "checkpoints", 20)
    assert ckpt.resolve_resume("auto", run) == older
    moved = ckpt.set_aside_newer(run / "checkpoints", 20)
    assert [p.name for p in moved] == [lost.name] and moved[0].parent.parent.name == SET_ASIDE_DIR


def test_a_finished_write_never_renamed_is_named_kept_and_set_aside(tmp_path, caplog):
    checkpoints = tmp_path / "run" / "checkpoints"
    finished = _fake_checkpoint(checkpoints, 24, complete=False)
    (finished / MANIFEST_FILE).write_text(json.dumps({"format": 1, "step": 24}))
    with caplog.at_level("WARNING"), pytest.raises(ConfigError, match="every checkpoint in"):
        ckpt.resolve_resume("auto", tmp_path / "run")
    assert f"rename it to {checkpoints / ckpt.checkpoint_name(24)}" in caplog.text
    _fake_checkpoint(checkpoints, 16)
    assert ckpt.resolve_resume("auto", tmp_path / "run").name == ckpt.checkpoint_name(16)
    moved = ckpt.set_aside_newer(checkpoints, 16)
    assert [p.name for p in moved] == [finished.name]


def test_a_changed_optimizer_is_reported_a_changed_model_refused():
    cfg = typed_config()
    manifest = {"path": "ck", "config": ckpt.config_fingerprint(cfg)}
    assert ckpt.resume_differences(manifest, cfg) == []
    assert ckpt.resume_differences(manifest, typed_config(["optim.lr=0.5", "cp=2"])) == [
        f"optim.lr: {cfg.optim.lr!r} -> 0.5"
    ], "the layout may change silently, the optimizer is reported"
    with pytest.raises(ConfigError, match=f"data.seed: {cfg.data.seed} -> 7"):
        ckpt.resume_differences(manifest, typed_config(["data.seed=7"]))


def _hand_written_fingerprint(cfg) -> dict:
    """config_fingerprint as it was written out by hand before it was derived from the
    dataclasses: what every checkpoint written before then records, key for key."""
    from dataclasses import asdict

    def flatten(node, prefix: str = "") -> dict:
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                out.update(flatten(value, f"{prefix}{key}."))
            return out
        return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}

    return flatten(
        {
            "model": asdict(cfg.model),
            "mtp": asdict(cfg.mtp),
            "vision": asdict(cfg.vision),
            "data": asdict(cfg.data),
            "batching": asdict(cfg.batching),
            "optim": asdict(cfg.optim),
            "trainer": {
                "max_steps": cfg.trainer.max_steps,
                "seed": cfg.trainer.seed,
                "precision": cfg.trainer.precision,
                "deterministic": cfg.trainer.deterministic,
                "engine": cfg.trainer.engine,
                "megatron": {
                    "calculate_per_token_loss": cfg.trainer.megatron.calculate_per_token_loss,
                    "sync_mtp_position_embeddings": (
                        cfg.trainer.megatron.sync_mtp_position_embeddings
                    ),
                },
            },
            "cp": {"preprocess": cfg.cp.preprocess},
            "parallel": {
                "tp": cfg.parallel.tp,
                "cp": cfg.cp.size,
                "dp": cfg.parallel.dp,
                "pp": cfg.parallel.pp,
            },
        }
    )


def _unusual_config():
    """Every recorded section away from its defaults, and the fields a checkpoint must not
    record (the other trainer settings, cp's other fields, sequence parallelism) changed too."""
    from recipe.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.num_layers, cfg.model.swiglu, cfg.model.position_embedding_type = 3, True, "mrope"
    cfg.mtp.enabled, cfg.mtp.num_layers, cfg.mtp.scaling = True, 2, "megatron"
    cfg.vision.enabled, cfg.vision.mrope_section = True, (2, 3, 3)  # a tuple: recorded as a list
    cfg.data.source, cfg.data.data_files = "files", {"train": ["a.jsonl", "b.jsonl"]}
    cfg.data.markov.order, cfg.data.shapes.image_size = 3, 64
    cfg.batching.tokens_per_step, cfg.batching.max_tokens_per_rank = 8192, 1024
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 5
    cfg.trainer.max_steps, cfg.trainer.seed, cfg.trainer.precision = 7, 3, "bf16"
    cfg.trainer.deterministic, cfg.trainer.engine = False, "megatron"
    cfg.trainer.megatron.calculate_per_token_loss = False
    cfg.trainer.megatron.sync_mtp_position_embeddings = False
    cfg.trainer.megatron.use_distributed_optimizer = True
    cfg.trainer.eval_every, cfg.trainer.checkpoint_every, cfg.trainer.resume = 3, 2, "auto"
    cfg.trainer.record_tokens, cfg.trainer.loss_spike.factor = [1, 2], 9.0
    cfg.cp.size, cfg.cp.preprocess, cfg.cp.check_steps, cfg.cp.comm_type = 4, "verl_fixed", 0, "a2a"
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.pp = 2, 3, 2
    cfg.parallel.sequence_parallel = True
    cfg.logger.wandb.mode, cfg.output_dir = "disabled", "/somewhere"
    return cfg


@pytest.mark.parametrize("which", ["default", "typed default", "unusual"])
def test_the_derived_fingerprint_is_the_hand_written_one(which):
    """Checkpoints written before the fingerprint was derived from the config's dataclasses
    must still resume: the same keys, in the same order, with the same values."""
    from recipe.config import TrainConfig

    cfg = {"default": TrainConfig, "typed default": typed_config, "unusual": _unusual_config}
    cfg = cfg[which]()
    derived, reference = ckpt.config_fingerprint(cfg), _hand_written_fingerprint(cfg)
    assert list(derived.items()) == list(reference.items())
    if which != "unusual":  # (its data files do not exist: resuming reads them)
        assert ckpt.resume_differences({"path": "c", "config": reference}, cfg) == []
    else:
        assert derived != _hand_written_fingerprint(TrainConfig()), "the negative control"
        assert derived["vision.mrope_section"] == [2, 3, 3]
        assert derived["data.data_files.train"] == ["a.jsonl", "b.jsonl"]
        assert derived["parallel.cp"] == 4 and "parallel.sequence_parallel" not in derived


def test_a_resume_marker_supersedes_the_steps_past_the_checkpoint():
    rows = [{"step": s, "v": s} for s in (1, 2, 3, 4, 5)]
    marker = {"resumed": {"from_step": 3}}
    resumed = [{"step": s, "v": -s} for s in (4, 5, 6)]
    assert effective_records(rows + [marker] + resumed) == rows[:3] + resumed
    assert effective_records(rows + [{"resumed": {"from_step": 0}}] + resumed[:1]) == resumed[:1]
    lines = [json.dumps(r) for r in rows] + ['{"step": 6, "v"', json.dumps(marker)]
    records, cut = parse_metrics_lines(lines + [json.dumps(r) for r in resumed])
    assert cut == [6] and records == rows[:3] + resumed
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        parse_metrics_lines([lines[0], "{oops", lines[1]])


def test_a_failed_metrics_write_leaves_only_whole_lines_and_names_the_file(tmp_path, monkeypatch):
    import errno

    from recipe.rundir import metrics

    logger = RunLogger(typed_config(), tmp_path, total_steps=3)
    logger.log_step({"step": 1, "loss": 1.0})
    real_write = os.write

    def disk_full_half_way(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics.os, "write", disk_full_half_way)
    with pytest.raises(OutputWriteError) as err:
        logger.log_step({"step": 2, "loss": 2.0})
    monkeypatch.setattr(metrics.os, "write", real_write)
    logger.close()
    assert f"could not write {tmp_path / 'metrics.jsonl'}: No space left on device" in str(
        err.value
    )
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_a_resumed_run_in_a_new_directory_gets_the_wholewithout_timings(tmp_path):
    history = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    logger = RunLogger(typed_config(), tmp_path, total_steps=4, first_step=2)
    logger.log_resume(2, history, Path("elsewhere/step_00000002"), [], run_id="r1")
    logger.log_step({"step": 3, "loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert run_id_in(tmp_path) == "r1", "the run continues under its own name"


def test_a_fresh_run_names_itself_in_its_first_line_and_readers_skip_it(tmp_path):
    logger = RunLogger(typed_config(), tmp_path, total_steps=2)
    logger.log_start("abc")
    logger.log_step({"step": 1, "loss": 1.0})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[0] == '{"run": {"id": "abc"}}'
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]
    assert run_id_in(tmp_path) == "abc" and run_id_in(tmp_path / "none") is None


def test_a_resume_into_a_directory_must_continue_the_timeline_it_records(tmp_path):
    """Ids alone cannot tell a fork from its parent (the fork inherits the id): the directory's
    records up to the checkpoint's step must be the checkpoint's history."""
    from recipe.launch.preflight import check_same_run

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "lm_loss": 5.0 - s} for s in range(1, 15)]
    lines = ['{"run": {"id": "a"}}', *map(json.dumps, rows)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    own = run / "checkpoints" / "step_00000012"
    check_same_run(str(run), own, {"step": 12, "history": rows[:12]})  # its own: accepted
    check_same_run(str(tmp_path / "new"), own, {"step": 16, "history": []})  # a new directory
    fork = [*rows[:12], *({"step": s, "lm_loss": 1.5 - s / 100} for s in range(13, 17))]
    with pytest.raises(ConfigError, match="records of step 13 differ .*new hydra.run.dir"):
        check_same_run(str(run), tmp_path / "fork" / "step_00000016", {"step": 16, "history": fork})
    # a fork whose change acts from the update on logs its first loss unchanged: the message
    # names the field that differs, not two equal losses
    fork = [*rows[:12], {**rows[12], "lr": 1e-4}, *({"step": s} for s in range(14, 17))]
    rows[12]["lr"] = 3e-4
    (run / "metrics.jsonl").write_text("\n".join([lines[0], *map(json.dumps, rows)]) + "\n")
    with pytest.raises(ConfigError, match=r"step 13 differ first in lr \(0.0003 there, 0.0001 in"):
        check_same_run(str(run), tmp_path / "fork" / "step_00000016", {"step": 16, "history": fork})
    with pytest.raises(ConfigError, match="records 14 steps up to that step, the checkpoint 16"):
        check_same_run(str(run), own, {"step": 16, "history": [*rows, *fork[14:]]})
    aside = run / "checkpoints" / "set_aside" / "from_step_8-20261204-101010" / "step_00000012"
    with pytest.raises(ConfigError, match="was set aside .*new hydra.run.dir"):
        check_same_run(str(run), aside, {"step": 12, "history": rows[:12]})
    check_same_run(str(tmp_path / "new"), aside, {"step": 12, "history": rows[:12]})


@pytest.mark.launches
def test_a_refused_resume_changes_nothing_in_the_directory_it_found(tmp_path, reference_cp1):
    """A finished run's directory, another run's checkpoint: exit 2 before anything is written,
    its metrics, summary and Hydra's .hydra/ files as they were."""
    other = tmp_path / "other"
    _train(other, "trainer.max_steps=2", "trainer.checkpoint_every=0")
    files = [other / "metrics.jsonl", other / "summary.json", *sorted((other / ".hydra").iterdir())]
    before = {f: f.read_bytes() for f in files}
    start = reference_cp1 / "checkpoints" / "step_00000008"
    done = run_train_cli([*RUN, f"trainer.resume={start}", f"hydra.run.dir={other}"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"run directory {other} records another timeline than checkpoint" in done.stderr
    assert {f: f.read_bytes() for f in files} == before


def _damage(checkpoint: Path, how: str) -> str:
    """Damage a real checkpoint; returns what the verification must name."""
    shard = next(checkpoint.glob("__*_0.distcp"))
    if how == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return f"{shard} has {len(data) // 2} bytes"
    if how == "missing":
        shard.unlink()
        return f"{shard} is missing"
    if how == "changed":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        return f"{shard} does not match its checksum"
    if how == "renamed":
        moved = checkpoint.with_name(ckpt.checkpoint_name(99))
        checkpoint.rename(moved)
        return "says step 24, the directory's name step 99"
    if how == "manifest_lost":
        (checkpoint / MANIFEST_FILE).unlink()
        return f"{checkpoint / MANIFEST_FILE} is missing (it holds .metadata, __0_0.distcp"
    if how in ("manifest_only", "old_manifest_only"):  # the manifest copied alone, shards lost
        for path in checkpoint.iterdir():
            if path.name != MANIFEST_FILE:
                path.unlink()
        if how == "manifest_only":
            return f"{checkpoint / '.metadata'} is missing"  # the first file it lists
        # the older format, written before files were listed: nothing to verify, nothing to load
        manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
        del manifest["files"]
        (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
        return (
            f"{checkpoint / MANIFEST_FILE} lists no files and {checkpoint / '.metadata'}, DCP's "
            f"index of the tensors' files, is missing (it holds {MANIFEST_FILE})"
        )
    raise ValueError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "missing",
        "changed",
        "renamed",
        "manifest_lost",
        "manifest_only",
        "old_manifest_only",
    ],
)
def test_a_damaged_checkpoint_is_skipped_by_auto_and_refused_by_name(
    how, tmp_path, reference_cp1, caplog
):
    """Every checkpoint lists its files with sizes and checksums; resume verifies them first."""
    run = tmp_path / "run"
    shutil.copytree(reference_cp1, run)
    newest = run / "checkpoints" / "step_00000024"
    manifest = ckpt.read_manifest(newest)
    assert set(manifest["files"]) >= {".metadata", "__0_0.distcp"}
    assert ckpt.checkpoint_problem(newest) is None
    what = _damage(newest, how)
    damaged = newest if how != "renamed" else newest.with_name(ckpt.checkpoint_name(99))
    assert what in ckpt.checkpoint_problem(damaged)
    with caplog.at_level("WARNING"):
        assert ckpt.resolve_resume("auto", run) == run / "checkpoints" / "step_00000016"
    assert f"skipping damaged checkpoint {damaged}" in caplog.text and what in caplog.text
    with pytest.raises(ConfigError, match=r"is damaged: .*newest before it is .*step_00000016"):
        ckpt.resolve_resume(str(damaged), None)
    if how in ("truncated", "old_manifest_only"):
        # every one damaged: auto refuses as naming the directory does, and leaves it as it was
        for step in (8, 16):
            _damage(run / "checkpoints" / ckpt.checkpoint_name(step), how)
        before = sorted(run.rglob("*"))
        for spec in ("auto", str(run)):
            with pytest.raises(ConfigError, match="every checkpoint in .* is damaged"):
                ckpt.resolve_resume(spec, run)
        assert sorted(run.rglob("*")) == before


@pytest.mark.launches
def test_auto_in_a_run_without_a_good_checkpoint_exits_2_and_changes_nothing(
    tmp_path, reference_cp1
):
    """No checkpoint to take: step 16's manifest removed (shards intact), step 8 only an older
    manifest (no file listing, no shards), step 24's write finished but never renamed. `auto`
    must not take the directory for a new run (which would write over them and prune the
    others), nor resume from the manifest alone; it names each and removes nothing."""
    run = tmp_path / "run"
    shutil.copytree(reference_cp1, run)
    checkpoints = run / "checkpoints"
    (checkpoints / "step_00000016" / MANIFEST_FILE).unlink()
    manifest_only = _damage(checkpoints / "step_00000008", "old_manifest_only")
    unrenamed = checkpoints / f"step_00000024{PARTIAL_SUFFIX}"
    (checkpoints / "step_00000024").rename(unrenamed)

    def kept():  # all but the job's log and lock file, which record the refused attempt
        files = (p for p in sorted(run.rglob("*")) if p.is_file())
        return {p: p.read_bytes() for p in files if p.suffix != ".log" and p.name != ".lock"}

    before = kept()
    done = run_train_cli(
        [*RUN, "trainer.max_steps=32", "trainer.resume=auto", f"hydra.run.dir={run}"], cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"every checkpoint in {checkpoints} is damaged" in done.stderr
    named = f"skipping damaged checkpoint {checkpoints / 'step_00000016'}: "
    assert named + f"{checkpoints / 'step_00000016' / MANIFEST_FILE} is missing" in done.stdout
    assert f"skipping damaged checkpoint {checkpoints / 'step_00000008'}: " in done.stdout
    assert manifest_only in done.stdout
    assert f"skipping {unrenamed}: its write finished" in done.stdout
    assert f"rename it to {checkpoints / 'step_00000024'}" in done.stdout
    assert kept() == before, "a refused resume must leave the directory as it found it"


def test_a_partial_checkpoint_is_never_resumed_even_with_its_manifest(tmp_path, reference_cp1):
    partial = tmp_path / "step_00000024.partial"
    shutil.copytree(reference_cp1 / "checkpoints" / "step_00000024", partial)
    assert (partial / "manifest.json").is_file()
    with pytest.raises(ConfigError, match="never completed"):
        ckpt.resolve_resume(str(partial), None)


def test_a_shard_the_tensors_need_is_checked_even_when_the_manifest_omits_it(
    tmp_path, reference_cp1
):
    """A checkpoint whose rank wrote its shard elsewhere (written before the write-time check):
    its manifest verifies, but the tensors' own metadata names the missing file."""
    from recipe.checkpoint.fs import write_atomically

    copy = tmp_path / "step_00000024"
    shutil.copytree(reference_cp1 / "checkpoints" / "step_00000024", copy)
    manifest = ckpt.read_manifest(copy)
    del manifest["files"]["__0_0.distcp"]
    write_atomically(copy / "manifest.json", json.dumps(manifest))
    (copy / "__0_0.distcp").unlink()
    problem = ckpt.checkpoint_problem(copy)
    assert (
        problem == f"{copy / '__0_0.distcp'} is missing (the checkpoint's tensors are stored in it)"
    )


def test_a_checkpoint_missing_a_ranks_part_is_not_completed(tmp_path):
    from recipe.checkpoint.store import CheckpointWriteError, check_every_rank_wrote_here

    listed = {".metadata": {}, "__0_0.distcp": {}, "__1_0.distcp": {}}
    check_every_rank_wrote_here(tmp_path, [["__0_0.distcp"], ["__1_0.distcp"]], listed)
    with pytest.raises(CheckpointWriteError, match="lacks rank 1's __1_0.distcp.*same hydra.run"):
        check_every_rank_wrote_here(
            tmp_path,
            [["__0_0.distcp"], ["__1_0.distcp"]],
            {".metadata": {}, "__0_0.distcp": {}},  # rank 1 wrote where rank 0 does not look
        )


def test_auto_resumes_past_a_truncated_newest_checkpoint_bit_for_bit(tmp_path, reference_cp1):
    """A truncated shard in the newest checkpoint: auto takes the one before it, and the curve
    equals the uninterrupted run's bit for bit."""
    from recipe.launch.rank import train

    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(reference_cp1 / "checkpoints", run / "checkpoints")
    head = read_metrics(reference_cp1)[:8]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in head))
    _damage(run / "checkpoints" / "step_00000016", "truncated")
    (run / "checkpoints" / "step_00000024").rename(run / "checkpoints" / "step_00000024.partial")
    train(typed_config([*RUN, "trainer.resume=auto"], output_dir=run))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (marker,) = [json.loads(line)["resumed"] for line in lines if '"resumed"' in line]
    assert marker["from_step"] == 8
    assert without_timings(read_metrics(run)) == without_timings(read_metrics(reference_cp1))


def test_one_line_says_where_training_starts():
    from recipe.launch.rank import where_training_starts

    assert where_training_starts(None, None, 0) == "starting at step 0"
    assert where_training_starts("auto", None, 0) == (
        "no checkpoint to resume in this run directory: starting at step 0"
    )
    assert where_training_starts("auto", Path("c/step_00000008"), 8) == (
        "resuming from c/step_00000008: training starts after step 8"
    )


def test_changes_that_alter_the_numbers_are_recorded_in_the_resume_marker():
    cfg = typed_config(list(RUN))
    manifest = {"path": "c", "config": ckpt.config_fingerprint(cfg)}
    changed = ["trainer.precision=bf16", "cp.preprocess=verl_fixed", "trainer.deterministic=false"]
    assert ckpt.resume_differences(manifest, typed_config([*RUN, *changed])) == [
        "cp.preprocess: 'index' -> 'verl_fixed'",
        "trainer.deterministic: True -> False",
        "trainer.precision: 'auto' -> 'bf16'",
    ]
    old = {k: v for k, v in manifest["config"].items() if not k.startswith(("cp.", "trainer.p"))}
    assert ckpt.resume_differences({"path": "c", "config": old}, cfg) == [], (
        "a checkpoint written before these were recorded had their defaults"
    )


def _corpus(path: Path, words: str) -> None:
    rows = [{"text": f"{words} number {i} " * 4} for i in range(120)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_regenerated_data_file_is_refused_on_resume_naming_it(tmp_path):
    """The manifest records each input file's size and SHA-256: a file regenerated under the
    same path is exit 2 naming it, unless trainer.allow_data_change=true says it is meant."""
    from recipe.launch.rank import train

    data = tmp_path / "corpus.jsonl"
    _corpus(data, "the first corpus")
    files = ["data=files", "data.path=json", f"data.data_files={data}", "data.max_seq_len=128"]
    run = tmp_path / "run"
    train(
        typed_config([*files, "trainer.max_steps=2", "trainer.checkpoint_every=2"], output_dir=run)
    )
    manifest = ckpt.read_manifest(run / "checkpoints" / "step_00000002")
    assert manifest["inputs"] == {str(data): {"size": data.stat().st_size, "sha256": sha256(data)}}
    resume = [*files, "trainer.max_steps=2", "trainer.resume=auto"]
    assert ckpt.resume_differences(manifest, typed_config(resume)) == []
    _corpus(data, "a regenerated corpus")
    with pytest.raises(ConfigError) as refused:
        ckpt.resume_differences(manifest, typed_config(resume))
    assert f"{data} changed (" in str(refused.value)
    assert "trainer.allow_data_change=true" in str(refused.value)
    allowed = ckpt.resume_differences(
        manifest, typed_config([*resume, "trainer.allow_data_change=true"])
    )
    before = manifest["inputs"][str(data)]["size"]
    assert allowed == [f"input {data} changed ({before} -> {data.stat().st_size} bytes)"]
    data.unlink()
    gone = fingerprint_changes(manifest["inputs"], {})
    assert gone == [f"{data} is no longer there"]


def test_rewinding_starts_a_new_timeline_that_auto_follows(tmp_path, reference_cp1):
    """Resume from step 8 in a directory that has 16 and 24: those are set aside (kept, not
    counted, never taken by auto). The new timeline is then cut short after step 18 (as a kill
    leaves it): auto continues it from its own step 16, and the curve is the uninterrupted one."""
    from recipe.launch.rank import train

    run = tmp_path / "run"
    shutil.copytree(reference_cp1, run)
    old_16 = ckpt.read_manifest(run / "checkpoints" / "step_00000016")["written_at"]
    start = run / "checkpoints" / "step_00000008"
    train(typed_config([*RUN, f"trainer.resume={start}"], output_dir=run))
    (aside,) = (run / "checkpoints" / SET_ASIDE_DIR).iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000016", "step_00000024"]
    assert ckpt.read_manifest(aside / "step_00000016")["written_at"] == old_16
    assert [s for s, _ in ckpt.complete_checkpoints(run / "checkpoints")] == [8, 16, 24]
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (marker,) = [r["resumed"] for r in records if "resumed" in r]
    assert marker["from_step"] == 8 and len(marker["set_aside"]) == 2
    # the new timeline killed after step 18: its step-24 checkpoint and steps 19-24 never made
    shutil.rmtree(run / "checkpoints" / "step_00000024")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:-6]) + "\n")
    new_16 = ckpt.resolve_resume("auto", run)
    assert new_16.name == "step_00000016" and ckpt.read_manifest(new_16)["written_at"] != old_16
    train(typed_config([*RUN, "trainer.resume=auto"], output_dir=run))
    assert without_timings(read_metrics(run)) == without_timings(read_metrics(reference_cp1))
    assert len(list((run / "checkpoints" / SET_ASIDE_DIR).iterdir())) == 1


def test_a_short_write_is_reported_as_the_full_disk_it_is(tmp_path, monkeypatch):
    """torch's writer reports a full disk as `unexpected pos N vs M` with no errno (seen on a
    600 KiB tmpfs); the message says ENOSPC and how much space is left, once."""
    from collections import namedtuple

    torch_says = RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    )
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fs.shutil, "disk_usage", lambda path: usage(600, 600, 0))
    assert fs.root_cause(torch_says, tmp_path / "checkpoints") == (
        "[Errno 28] No space left on device (a short write: torch says 'unexpected pos 704 vs "
        "598'; 0 bytes free there)"
    )
    monkeypatch.setattr(fs.shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 40))
    assert fs.root_cause(torch_says, tmp_path).endswith("(a quota, or a failing device?)")
    assert fs.root_cause(RuntimeError("other"), tmp_path) == "RuntimeError: other"
