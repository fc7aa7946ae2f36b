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
    # The spawned rank 0 logs to the console and train.log as a world of one does (it logged
    # nowhere); rank 1 repeats none of it, and no line says the world came from outside.
    shown = [line for line in result.stdout.splitlines() if line.strip()]
    assert shown[0] == "starting at step 0", result.stdout
    assert result.stdout.count("starting at step 0") == 1
    log = (run_dir / "train.log").read_text()
    assert all(line in log for line in shown), log


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
    """The README's torchrun line as written (no hydra.run.dir): both ranks write into one run
    directory, named by torchrun's run id; each checkpoint holds and lists both ranks' shards,
    verifies, and resumes under torchrun into a new directory."""
    from recipe.checkpoint import checkpoint_problem
    from recipe.rundir.metrics import read_metrics

    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    result = run_train_cli(
        ["cp=2", "trainer.max_steps=2", "trainer.checkpoint_every=1"],
        cwd=tmp_path,
        launcher=torchrun,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = tmp_path.rglob("metrics.jsonl")
    run = metrics.parent
    assert result.stdout.count("starting at step 0") == 1, "rank 0 alone logs information"
    assert "starting at step 0" in (run / "train.log").read_text()
    assert run.parent == tmp_path / "outputs" / "torchrun", run
    assert [p.parent for p in tmp_path.rglob(".hydra")] == [run]
    assert [p.parent for p in tmp_path.rglob("checkpoints")] == [run], "no shard elsewhere"
    newest = run / "checkpoints" / "step_00000002"
    listed = json.loads((newest / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(listed)
    assert checkpoint_problem(newest) is None
    resumed = run_train_cli(
        ["cp=2", "trainer.max_steps=3", f"trainer.resume={newest}", "hydra.run.dir=resumed"],
        cwd=tmp_path,
        launcher=torchrun,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3]


def test_the_ranks_of_a_launched_world_name_one_run_directory():
    from recipe.launch.overrides import run_dir_for_launched_rank

    args = ["cp=2"]
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}
    shared = "hydra.run.dir=outputs/torchrun/abc"
    assert run_dir_for_launched_rank(args, {}) == args, "a lone process keeps Hydra's default"
    assert run_dir_for_launched_rank(args, torchrun) == [*args, shared]
    other = run_dir_for_launched_rank(args, {**torchrun, "RANK": "1"})
    assert other[:2] == [*args, shared]
    assert "hydra.output_subdir=null" in other, "only rank 0 writes Hydra's files"
    assert run_dir_for_launched_rank(args, {"SLURM_PROCID": "2"}) == args  # no rendezvous: lone
    slurm = {"SLURM_PROCID": "2", "MASTER_ADDR": "n1", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    assert "hydra.run.dir=outputs/slurm/77.0" in run_dir_for_launched_rank(args, slurm)
    named = run_dir_for_launched_rank([*args, "hydra.run.dir=/runs/a"], {**torchrun, "RANK": "1"})
    assert [a for a in named if a.startswith("hydra.run.dir")] == ["hydra.run.dir=/runs/a"]
    with pytest.raises(ConfigError, match="same hydra.run.dir=DIR to every rank"):
        run_dir_for_launched_rank(args, {"RANK": "1", "WORLD_SIZE": "2"})  # no run id
    assert run_dir_for_launched_rank(["-m", *args], {**torchrun, "RANK": "1"}) == ["-m", *args]


def test_ranks_that_name_different_run_directories_are_refused():
    from recipe.launch.rank import check_one_run_directory

    check_one_run_directory(["/runs/a", "/runs/a"])
    with pytest.raises(ConfigError, match="rank 0: /runs/a, rank 1: /tmp/b.*same hydra.run.dir"):
        check_one_run_directory(["/runs/a", "/tmp/b"])


def test_sweep_jobs_share_a_wandb_group_and_carry_their_overrides_as_tags(tmp_path):
    from recipe.launch.task import group_sweep_in_wandb

    sweep = tmp_path / "multirun" / "2026-12-01" / "10-00-00-123456"
    cfg = typed_config(output_dir=sweep / "3")
    group_sweep_in_wandb(cfg, ["cp='2'", "mtp=on", "hydra.verbose=true"])
    assert cfg.logger.wandb.group == "sweep-2026-12-01-10-00-00-123456"
    assert cfg.logger.wandb.tags == ["cp='2'", "mtp=on"]
    other = typed_config(output_dir=sweep / "4")
    group_sweep_in_wandb(other, ["cp='1'"])
    assert other.logger.wandb.group == cfg.logger.wandb.group


def _clock_at(microsecond: int):
    """A datetime whose now() is 2026-12-01 10:00:00 and `microsecond`: the same second."""
    import datetime

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 1, 10, 0, 0, microsecond)

    return Clock


def test_two_sweeps_started_in_the_same_second_get_their_own_directories(monkeypatch):
    """Two sweeps started in the same second shared multirun/DATE/HH-MM-SS, and every job of both
    died: its directory was in use by the other sweep's job of the same number."""
    import hydra.core.utils

    from recipe.launch.compose import compose_config

    seen = []
    for microsecond in (1, 2):
        monkeypatch.setattr(hydra.core.utils, "datetime", _clock_at(microsecond))
        hydra_cfg = compose_config([], return_hydra_config=True).hydra
        seen.append((hydra_cfg.sweep.dir, hydra_cfg.run.dir))
    assert seen[0] == ("multirun/2026-12-01/10-00-00-000001", "outputs/2026-12-01/10-00-00-000001")
    assert seen[1][0] == "multirun/2026-12-01/10-00-00-000002"


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


def _no_wandb_login(monkeypatch, home):
    """A user who never ran `wandb login`: no key in the environment, no netrc, no settings."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))


def test_wandb_online_without_a_key_is_refused_at_start_up(tmp_path, monkeypatch):
    """wandb online without a login failed once the model was built, with wandb's traceback. Its
    own lookup is asked (no prompt, no network): a netrc entry or WANDB_API_KEY is enough."""
    import torch

    from recipe.launch.preflight import check_run_choices

    wandb = pytest.importorskip("wandb", reason="the GPU kit's stack has no wandb")
    _no_wandb_login(monkeypatch, tmp_path)
    online = typed_config(["logger.wandb.mode=online"])
    cpu = torch.device("cpu")
    try:
        with pytest.raises(ConfigError) as info:
            check_run_choices(online, cpu)
        assert str(info.value).startswith("logger.wandb.mode=online needs a wandb API key")
        for fix in ("`wandb login`", "WANDB_API_KEY", "logger.wandb.mode=offline"):
            assert fix in str(info.value)
        check_run_choices(typed_config(["logger.wandb.mode=offline"]), cpu)  # needs no login
        netrc = tmp_path / ".netrc"
        netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'k' * 40}\n")
        check_run_choices(online, cpu)  # what `wandb login` writes
        netrc.unlink()
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
        check_run_choices(online, cpu)
        monkeypatch.setenv("WANDB_API_KEY", "typo")
        with pytest.raises(ConfigError, match="WANDB_API_KEY invalid: API key must have 40"):
            check_run_choices(online, cpu)
    finally:
        wandb.teardown()  # the lookup may have made wandb's process-wide settings from this HOME


def test_wandb_that_is_not_installed_is_refused_at_start_up(monkeypatch):
    import importlib.util

    import torch

    from recipe.launch.preflight import check_run_choices

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="mode=offline needs wandb, which is not installed"):
        check_run_choices(typed_config(["logger.wandb.mode=offline"]), torch.device("cpu"))
    check_run_choices(typed_config(["logger.wandb.mode=disabled"]), torch.device("cpu"))


@pytest.mark.launches
def test_cli_wandb_online_without_a_key_stops_before_any_work(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    result = run_train_cli(
        ["logger.wandb.mode=online", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=120,
        env_extra={"HOME": str(home), "WANDB_API_KEY": "", "NETRC": str(home / ".netrc")},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(
        "config error: logger.wandb.mode=online needs a wandb API key"
    )
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


# A process set up as a rank is: RANK set, then logging as the launcher path sets it up, then one
# information and one warning line through the recipe's logger.
_LOG_AS_RANK = """
import sys
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import configure_log
from recipe.launch.compose import compose_config
from recipe.log import JobLogging, get_logger, set_up_spawned_rank

how, run_dir, *overrides = sys.argv[1:]
cfg = compose_config([f"hydra.run.dir={run_dir}", *overrides], return_hydra_config=True)
cfg.hydra.runtime.output_dir = run_dir  # what Hydra sets when it runs train.py
cfg.hydra.job.name = "train"
HydraConfig.instance().set_config(cfg)
if how == "hydra":  # a rank of torchrun, SLURM or submitit: Hydra runs the job in it
    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)
else:  # a rank launch_world spawned: the job's set-up, as the job's process hands it over
    set_up_spawned_rank(JobLogging.of_this_job())
get_logger("recipe.test").info("an information line")
get_logger("recipe.test").warning("a warning line")
"""


@pytest.mark.launches
@pytest.mark.parametrize(
    "how, rank",
    [("spawned", 0), ("spawned", 1), ("hydra", 1)],
    ids=["spawned-rank-0", "spawned-rank-1", "launched-rank-1"],
)
def test_rank_0_logs_to_console_and_train_log_other_ranks_warn_naming_themselves(
    tmp_path, how, rank
):
    """A rank the recipe spawns is a fresh interpreter: rank 0 logged nowhere, so its `starting
    at step 0` and set-aside warnings reached neither console nor train.log. A rank other than 0
    of torchrun/SLURM/submitit (Hydra's `disabled` logging) dropped its warnings."""
    import subprocess
    import sys

    from recipe.launch.overrides import QUIET_HYDRA_OUTPUTS

    log = tmp_path / "train.log"
    log.write_text("[the job's own process] a line written before the ranks started\n")
    extra = list(QUIET_HYDRA_OUTPUTS) if how == "hydra" else []
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
    done = subprocess.run(
        [sys.executable, "-c", _LOG_AS_RANK, how, str(tmp_path), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    if rank == 0:
        assert done.stdout == "an information line\na warning line\n"
        written = log.read_text().splitlines()
        assert written[0].startswith("[the job's own process]"), "appended, not overwritten"
        assert written[1].endswith("[recipe.test][INFO] - an information line")
        assert written[2].endswith("[recipe.test][WARNING] - a warning line")
    else:
        assert done.stdout == "" and "information" not in done.stderr
        assert "rank 1: a warning line" in done.stderr.splitlines()
        assert len(log.read_text().splitlines()) == 1, "train.log is rank 0's"
