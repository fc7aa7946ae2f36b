"""Launching: `python train.py cp=2` starts its own ranks, one output directory, prompt failures."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from recipe.config import ConfigError
from recipe.launch.local import RanksFailed, check_launchable, launch_world, max_local_ranks
from tests.helpers.cli import run_train_cli
from tests.helpers.config import typed_config

ROOT = Path(__file__).resolve().parent.parent


def _fail_on_rank_1_while_rank_0_waits(cfg):
    """Rank 1 raises, saying where the launcher told it rank 0 is (MASTER_ADDR); rank 0 blocks
    in a collective that can never complete."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError(f"injected failure on rank 1 (MASTER_ADDR={os.environ['MASTER_ADDR']})")
    dist.all_reduce(torch.ones(1))  # would hang forever without the agent stepping in
    return {}


@pytest.mark.distributed
def test_a_failing_rank_ends_the_job_promptly_with_its_error(capfd):
    cfg = typed_config(["cp=2"])
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        launch_world(cfg, entrypoint=_fail_on_rank_1_while_rank_0_waits)
    assert time.monotonic() - start < 60
    assert "rank 1 failed" in str(info.value)
    assert "injected failure on rank 1" in str(info.value)
    # the ranks meet on loopback, never on a host name that may not resolve
    assert "(MASTER_ADDR=127.0.0.1)" in str(info.value)


def test_too_many_ranks_for_the_machine_is_refused_before_launch():
    cfg = typed_config(["cp=4", f"parallel.dp={max_local_ranks()}"])
    with pytest.raises(ConfigError, match=r"tp\*cp\*dp .* ranks, but this machine"):
        check_launchable(cfg)
    check_launchable(typed_config(["cp=2"]))  # a sane size passes


@pytest.mark.distributed
def test_cli_cp2_self_launches_into_exactly_one_output_directory(tmp_path):
    result = run_train_cli(["cp=2", "trainer.max_steps=3"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dirs = {p.parent for p in tmp_path.rglob("metrics.jsonl")}
    assert len(run_dirs) == 1
    (run_dir,) = run_dirs
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert len(list(tmp_path.rglob(".hydra"))) == 1, "ranks must not create their own folders"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert list(rows[0]) == ["run"], "the first line names the run"
    assert [r["step"] for r in rows[1:]] == [1, 2, 3], "only rank 0 writes metrics"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


@pytest.mark.launches
def test_cli_bad_config_exits_2_with_the_field_named(tmp_path):
    result = run_train_cli(["model.hidden_size=33"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "config error: model.hidden_size=33" in result.stderr
    assert "config error" not in result.stdout, "errors go to stderr only"
    assert not list(tmp_path.rglob("metrics.jsonl"))
    (log,) = tmp_path.rglob("train.log")
    assert "config error: model.hidden_size=33" in log.read_text()


@pytest.mark.launches
def test_cli_data_files_trains_on_a_local_jsonl(tmp_path):
    data = tmp_path / "corpus.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"line {i} of a tiny corpus. " * 8}) + "\n" for i in range(40))
    )
    result = run_train_cli(
        [
            "data=files",
            "data.path=json",
            f"data.data_files={data}",
            "data.text_field=text",
            "data.max_seq_len=256",
            "trainer.max_steps=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["entropy_floor"] is None
    # Hydra's train.log holds what the console showed (with timestamps).
    shown = [line for line in result.stdout.splitlines() if line.strip()]
    assert shown[0] == "starting at step 0", "one line says where training starts"
    assert shown[1].startswith("run directory:") and len(shown) >= 9
    log = (tmp_path / "run" / "train.log").read_text()
    assert all(line in log for line in shown), log


def test_launcher_environment_is_used_when_present(monkeypatch):
    from recipe.environment import adopt_environment

    assert not adopt_environment().external
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert not adopt_environment().external, "SLURM without MASTER_ADDR cannot rendezvous"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert adopt_environment().external
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "8")


@pytest.mark.distributed
def test_torchrun_ranks_share_one_output_directory(tmp_path):
    result = run_train_cli(
        ["cp=2", "trainer.max_steps=2"],
        cwd=tmp_path,
        launcher=["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list(tmp_path.rglob("metrics.jsonl"))) == 1
    assert len(list(tmp_path.rglob(".hydra"))) == 1


def test_only_rank_0_gets_a_hydra_run_directory():
    from recipe.launch.overrides import single_run_dir_for_rank

    args = ["cp=2"]
    assert single_run_dir_for_rank(args, {}) == args
    assert single_run_dir_for_rank(args, {"RANK": "0"}) == args
    other = single_run_dir_for_rank(args, {"RANK": "1", "WORLD_SIZE": "2"})
    assert other[:1] == args and "hydra.run.dir=." in other and "hydra.output_subdir=null" in other
    assert single_run_dir_for_rank(args, {"SLURM_PROCID": "2"}) == args  # no rendezvous: lone
    named = single_run_dir_for_rank(
        [*args, "hydra.run.dir=/runs/a"], {"RANK": "1", "WORLD_SIZE": "2"}
    )
    assert "hydra.run.dir=." not in named and "hydra.output_subdir=null" in named, "shards go there"
    assert "hydra.run.dir=." in single_run_dir_for_rank(
        args, {"SLURM_PROCID": "2", "MASTER_ADDR": "n1"}
    )


def test_sweep_jobs_share_a_wandb_group_and_carry_their_overrides_as_tags(tmp_path):
    from recipe.launch.task import group_sweep_in_wandb

    cfg = typed_config(output_dir=tmp_path / "multirun" / "2026-12-01" / "10-00-00" / "3")
    group_sweep_in_wandb(cfg, ["cp='2'", "mtp=on", "hydra.verbose=true"])
    assert cfg.logger.wandb.group == "sweep-2026-12-01-10-00-00"
    assert cfg.logger.wandb.tags == ["cp='2'", "mtp=on"]
    other = typed_config(output_dir=tmp_path / "multirun" / "2026-12-01" / "10-00-00" / "4")
    group_sweep_in_wandb(other, ["cp='1'"])
    assert other.logger.wandb.group == cfg.logger.wandb.group


@pytest.mark.launches
def test_cli_te_backend_without_cuda_stops_before_any_work(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    result = run_train_cli(["model.attention_backend=te", "cp=2"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "config error: model.attention_backend=te needs CUDA" in result.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_the_root_failure_is_reported_first_even_when_a_peer_is_noticed_first():
    """Seen in CI: rank 1 raised, rank 0's all_reduce then lost its peer and the agent noticed
    rank 0 first (and SIGTERMed rank 1 after it had recorded its error)."""
    from types import SimpleNamespace

    from recipe.launch.local import describe_failures

    def failure(exitcode, message, timestamp=0):
        return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp)

    lost_peer = {"message": "RuntimeError: Connection closed by peer [127.0.0.1]:61677"}
    injected = {"message": "RuntimeError: injected failure on rank 1"}
    text = describe_failures({0: failure(-6, lost_peer), 1: failure(-15, injected, timestamp=1)})
    assert text.startswith("rank 1 failed (exit code -15)") and "injected failure" in text
    assert "(also failed: rank 0, exit code -6: RuntimeError: Connection closed by peer" in text
    # No recorded error at all (killed before writing one) ranks after a recorded one.
    text = describe_failures({0: failure(-15, "no error file"), 1: failure(1, injected, 5)})
    assert text.startswith("rank 1 failed")


def test_a_recipe_error_in_a_rank_is_reported_once_without_its_traceback():
    """A rank's own error (a full disk, a config error) already names the problem and the fix;
    any other exception keeps its traceback, which is what finds a bug."""
    from types import SimpleNamespace

    from recipe.launch.local import describe_failures, recipe_error_line

    stack = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "recipe.checkpoint.store.CheckpointWriteError: could not write checkpoint c: full\n"
    )
    ours = {"message": "CheckpointWriteError: could not write checkpoint c: full",
            "extraInfo": {"py_callstack": stack}}  # fmt: skip
    assert recipe_error_line(stack) == "CheckpointWriteError: could not write checkpoint c: full"
    text = describe_failures({1: SimpleNamespace(exitcode=1, message=ours, timestamp=0)})
    assert text.endswith(": CheckpointWriteError: could not write checkpoint c: full")
    assert "Traceback" not in text and text.count("could not write") == 1
    theirs = stack.replace("recipe.checkpoint.store.CheckpointWriteError", "KeyError")
    assert recipe_error_line(theirs) is None
    assert recipe_error_line(stack.replace("CheckpointWriteError", "Nope")) is None
