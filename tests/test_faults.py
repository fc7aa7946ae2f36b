"""Faults a user meets, reproduced: each must end promptly with a message that names the cause.

(A catalogue that grows with the reliability work: a stalled rank here; failed and FAILing sweeps
and single runs in tests/test_compare.py; killed ranks and bad configs in tests/test_launch.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.host_memory import HOST_MEMORY_DEFAULTS, OPT_OUT
from tests.helpers.cli import RANK_VARIABLES, start_train_cli, wait_for_steps
from tests.helpers.config import ROOT, TINY

TIMEOUT_S = 10
# torch elastic gives the remaining (here: stopped) worker 30 s after SIGTERM before SIGKILL (by
# default; the test sets 2 s): the margin covers either.
SHUTDOWN_MARGIN_S = 60


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = []
    for child in map(int, children.stdout.split()):
        found += [child, *_descendants(child)]
    return found


def _rank_processes(pid: int) -> list[int]:
    """The spawned rank processes of a self-launched job, in start (= local rank) order."""
    ranks = []
    for child in _descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            ranks.append(child)
    return sorted(ranks)


def _started_with(pid: int) -> dict[str, str]:
    """The environment a process was started with (/proc shows none of its later changes)."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _check_host_memory_bounds(job_pid: int, ranks: list[int]) -> None:
    """train.py bounds the host's caches (recipe/host_memory.py) before it starts the ranks: each
    rank starts with the bounds the test's environment did not set itself, while the launching
    process started without them (so they came from train.py, not from the test)."""
    if os.environ.get(OPT_OUT) == "0":
        return
    unset = {k: v for k, v in HOST_MEMORY_DEFAULTS.items() if k not in os.environ}
    assert not unset.keys() & _started_with(job_pid).keys()
    for rank in ranks:
        started_with = _started_with(rank)
        assert {k: started_with.get(k) for k in unset} == unset, f"rank pid {rank}"


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").exists(), reason="finds rank processes through /proc")
def test_a_stalled_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    """SIGSTOP of rank 1 at cp=2 used to block rank 0 silently for more than 9 minutes: megatron's
    groups, which carry the CP exchanges and gradients, kept megatron's 30-minute timeout."""
    run_dir = tmp_path / "run"
    job = start_train_cli(
        ["cp=2", "trainer.max_steps=500", f"trainer.collective_timeout_s={TIMEOUT_S}"],
        run_dir,
        # torch elastic's grace between SIGTERM and SIGKILL of the stopped rank: 30 s of a
        # stopped process is not what this tests (the collective timeout is)
        env_extra={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"},
        stderr=subprocess.STDOUT,
    )
    stalled = None
    try:
        wait_for_steps(job, run_dir, 2)
        ranks = _rank_processes(job.pid)
        assert len(ranks) == 2, ranks
        # here, not in a job of its own: it needs launched ranks, and CI time is tight
        _check_host_memory_bounds(job.pid, ranks)
        stalled = ranks[1]
        os.kill(stalled, signal.SIGSTOP)
        stopped_at = time.monotonic()
        output, _ = job.communicate(timeout=TIMEOUT_S + SHUTDOWN_MARGIN_S + 60)
        took = time.monotonic() - stopped_at
    finally:
        if job.poll() is None:
            job.kill()
        if stalled is not None:
            try:
                os.kill(stalled, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert job.returncode == 1
    assert took < TIMEOUT_S + SHUTDOWN_MARGIN_S, f"took {took:.0f} s"
    assert f"rank 0 waited more than {TIMEOUT_S} s for the other ranks in" in output
    assert f"trainer.collective_timeout_s={TIMEOUT_S}" in output


def _strict_json_lines(path: Path) -> list[dict]:
    import json

    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.launches
def test_a_diverging_run_stops_at_the_first_nonfinite_step_with_strict_json(tmp_path):
    """optim.lr=1e3 used to go to NaN and exit 0, with bare NaN in metrics.jsonl. (lr=1e30 here:
    it overflows on every stack's numerics, lr=1e3 only on some.)"""
    from tests.helpers.cli import run_train_cli

    result = run_train_cli(
        ["optim.lr=1e30", "trainer.max_steps=20", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )
    assert result.returncode == 1
    records = _strict_json_lines(tmp_path / "run" / "metrics.jsonl")
    bad = records[-1]
    assert bad["nonfinite"] and all(bad[k] is None for k in bad["nonfinite"])
    assert all("nonfinite" not in r for r in records[:-1]), "it stops at the first one"
    assert f"step {bad['step']}: " in result.stderr
    assert "trainer.on_nonfinite=stop" in result.stderr


def test_skip_step_leaves_the_weights_alone_and_goes_on():
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.training.trainer import Trainer
    from tests.helpers.config import typed_config
    from tests.helpers.world import lone_world

    # lr=1e30: the first update puts weights near 1e30, so the next logits overflow on every
    # stack (lr=1e3 diverges to NaN on one release's numerics and stays finite on the other's).
    cfg = typed_config(["optim.lr=1e30", "trainer.max_steps=6", "trainer.on_nonfinite=skip_step"])
    with lone_world() as layout:
        trainer = Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data))
        skipped = 0
        while trainer.step < cfg.trainer.max_steps:
            before = [p.detach().clone() for p in trainer.model.parameters()]
            record = trainer.train_step().to_record()
            after = list(trainer.model.parameters())
            unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
            assert unchanged == bool(record.get("nonfinite")), record
            skipped += unchanged
    assert skipped, "lr=1e30 overflows within 6 steps"


def test_unknown_keys_are_refused_even_when_added_with_plus():
    """`+trainer.max_step=5` (the form Hydra's own hint suggests for a typo) was accepted and
    ignored: the run trained its 500 steps."""
    from recipe.config import ConfigError
    from tests.helpers.config import typed_config

    with pytest.raises(ConfigError, match="unknown config key trainer.max_step; did you mean "):
        typed_config(["+trainer.max_step=5"])
    with pytest.raises(ConfigError, match="unknown config key foo$"):
        typed_config(["+foo=1"])
    with pytest.raises(ConfigError, match="data.markov.ordr; did you mean data.markov.order"):
        typed_config(["+data.markov.ordr=3"])


def test_a_typo_in_an_override_key_is_named_with_the_closest_key():
    """`trainer.max_step=5` (no `+`) got Hydra's advice to add the key with `+`."""
    from recipe.launch.overrides import check_override_keys
    from tests.helpers.config import CONF_DIR

    conf = Path(CONF_DIR)
    typo = "unknown config key trainer.max_step; did you mean trainer.max_steps?"
    assert check_override_keys(["trainer.max_step=5"], conf) == typo
    assert check_override_keys(["+trainer.max_step=5"], conf) == typo
    assert check_override_keys(["-m", "cp=1,2", "trainer.max_step=1,2"], conf) == typo
    assert check_override_keys(["max_steps=5"], conf).endswith("did you mean trainer.max_steps?")
    assert check_override_keys(["data.markov.ordr=3"], conf).endswith("data.markov.order?")
    assert check_override_keys(["trainr.max_steps=5"], conf).endswith("did you mean trainer?")
    # Hydra's own keys against Hydra's schema: Hydra's answer is "To append ... use +hydra..."
    hydra_typo = "unknown config key hydra.run.dirr; did you mean hydra.run.dir?"
    assert check_override_keys(["hydra.run.dirr=out/x"], conf) == hydra_typo
    assert check_override_keys(["hydra.sweepr.dir=x"], conf).endswith("hydra.sweeper?")
    # What Hydra owns, group choices and real keys pass (Hydra still refuses `+` of a real key).
    for args in (
        ["trainer.max_steps=5", "+trainer.max_steps=5", "++optim.lr=1e-3"],
        ["-m", "cp=1,2", "experiment=cp_parity", "model=small", "mtp=on"],
        ["hydra.sweep.dir=x", "hydra/launcher=slurm", "hydra.verbose=true", "--cfg", "job"],
        ["hydra.job.chdir=false", "+hydra.job.env_set.X=1", "hydra.launcher.partition=gpu"],
        ["~trainer.resume", "data.data_files.train=a.jsonl", "vision.mrope_section=[4,6,6]"],
    ):
        assert check_override_keys(args, conf) is None, args


@pytest.mark.parametrize("value", ["null", "", "''"])
def test_a_group_set_to_nothing_is_named_with_its_options(value):
    """`convention=null` and `cp=null` were a Python traceback (even `experiment=null`, whose
    default is null), `convention=` Hydra's "could not find 'convention/'" with exit 1."""
    from recipe.launch.overrides import check_group_choices
    from tests.helpers.config import CONF_DIR

    groups = {
        "convention": "bridge@0.6.2, megatron_lm, recipe, verl@0.9.1",
        "cp": "1, 2, 4, 8",
        "experiment": "conventions, cp_parity",
    }
    for group, options in groups.items():
        message = check_group_choices([f"{group}={value}"], Path(CONF_DIR))
        assert message.startswith(f"{group}={value}: a config group takes one of its options "
                                  f"({options}"), message  # fmt: skip
        assert message.endswith(f"leave {group} out for its default")
    assert check_group_choices(["cp=2", "convention=megatron_lm"], Path(CONF_DIR)) is None


def test_a_run_directory_that_cannot_be_made_is_named_before_hydra(tmp_path):
    """A read-only run directory ended in Hydra's logging traceback. (The read-only case is
    played by `writable`: the tests run as root, for whom a read-only folder is writable; a
    read-only mount gave the same message by hand.)"""
    from recipe.launch.overrides import check_output_directory

    afile = tmp_path / "afile"
    afile.write_text("")
    message = check_output_directory([f"hydra.run.dir={afile}/run"], tmp_path)
    assert message == (
        f"hydra.run.dir={afile}/run: {afile} is a file, not a folder; give a run directory "
        "elsewhere"
    )
    sweep = ["-m", "cp=1,2", f"hydra.sweep.dir={afile}/sweep/${{now:%H}}"]
    assert check_output_directory(sweep, tmp_path).startswith(f"hydra.sweep.dir={afile}/sweep/")
    read_only = check_output_directory(["cp=2"], tmp_path, writable=lambda path: False)
    assert read_only == (
        f"hydra.run.dir (default outputs/..., under {tmp_path}): {tmp_path} cannot be written (a "
        "read-only file system, or no permission); give a run directory you can write, e.g. "
        "hydra.run.dir=$HOME/runs/NAME"
    )
    assert check_output_directory([f"hydra.run.dir={tmp_path}/a/b"], tmp_path) is None
    # a config of the user's may set the directory: not judged by the default
    assert check_output_directory(["experiment=cp_parity"], tmp_path, lambda p: False) is None
    assert check_output_directory(["hydra.run.dir=${oc.env:RUNS}/x"], tmp_path) is None


@pytest.mark.launches
def test_cli_a_typo_in_an_override_key_exits_2_with_one_line(tmp_path):
    from tests.helpers.cli import run_train_cli

    result = run_train_cli(["trainer.max_step=5"], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "config error: unknown config key trainer.max_step; did you mean trainer.max_steps?"
    )
    assert not list(tmp_path.iterdir()), "refused before Hydra makes a run directory"


@pytest.mark.launches
def test_a_run_directory_holds_one_job_and_is_never_overwritten(tmp_path):
    """Two jobs with the same run directory both exited 0 and one job's metrics were gone;
    reusing a directory truncated metrics.jsonl."""
    from tests.helpers.cli import run_train_cli

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    first = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, "trainer.max_steps=500"]
        + [f"hydra.run.dir={run_dir}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        second = run_train_cli([f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
        assert second.returncode == 2
        assert f"run directory {run_dir} is in use by another job (pid {first.pid})" in (
            second.stderr
        )
        assert first.poll() is None, "the first job goes on"
    finally:
        first.kill()
        first.wait()
    kept = (run_dir / "metrics.jsonl").read_text()
    again = run_train_cli([f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert again.returncode == 2, "the lock died with the killed job; the metrics are protected"
    assert "already holds the metrics of an earlier run" in again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == kept


def test_the_default_run_directory_is_unique_per_start():
    """outputs/DATE/HH-MM-SS made two jobs started in the same second share one directory."""
    import re

    from hydra import compose, initialize_config_dir

    from recipe.config import register_configs
    from tests.helpers.config import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d{6}", cfg.hydra.run.dir)


@pytest.mark.launches
def test_stale_rank_variables_are_named_not_waited_on_in_silence(tmp_path):
    """A stale RANK=0 WORLD_SIZE=2 MASTER_ADDR/PORT waited 5 minutes in silence, then printed a
    store traceback that did not say those variables made the recipe think it was launched."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["WANDB_MODE"] = "disabled"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *TINY, "cp=2", "trainer.collective_timeout_s=5"]
        + [f"hydra.run.dir={tmp_path / 'run'}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2
    assert time.monotonic() - started < 120
    named = f"RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
    assert f"joining a world of 2 ranks started outside the recipe ({named})" in result.stdout
    assert f"did not join within 5 s. {named} came from the environment" in result.stderr


def test_a_launched_world_of_the_wrong_size_names_the_variables(monkeypatch):
    from recipe.config import ConfigError
    from recipe.config.layout import ParallelDims
    from recipe.environment import read_environment
    from recipe.parallel import groups

    stale = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for key, value in stale.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"launch 1 processes.*\(RANK=0 WORLD_SIZE=2 MASTER_ADDR"):
        groups.init_distributed(ParallelDims(), read_environment(stale))


def test_rows_that_are_not_text_are_counted_and_too_many_are_an_error(tmp_path):
    """24 of 40 rows (missing, null, numbers, lists) used to be skipped without a word."""
    import json

    from recipe.config import ConfigError
    from recipe.data.sources import file_documents
    from tests.helpers.config import typed_config

    rows = []
    for i in range(40):
        kind = i % 5
        row = {"text": f"document {i}"} if kind in (0, 1) else {"other": i}
        if kind == 3:
            row = {"text": None}
        elif kind == 4:
            row = {"text": [i]} if i % 2 else {"text": i}
        rows.append(row)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["data=files", "data.path=json", f"data.data_files={data}"]
    with pytest.raises(ConfigError, match=r"24 of 40 rows of column 'text' are not text"):
        file_documents(typed_config(base).data)
    texts = file_documents(typed_config([*base, "data.max_malformed_fraction=1"]).data)
    assert len(texts) == 16


def test_unreadable_files_name_the_file_and_the_cause(tmp_path):
    """Non-UTF-8 or empty text files gave a generic DatasetGenerationError; a file given as
    data.path said only "Couldn't find any data file"."""
    from recipe.config import ConfigError
    from recipe.data.sources import file_documents
    from tests.helpers.config import typed_config

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café au lait\n".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")

    def load(*overrides):
        return file_documents(typed_config(["data=files", *overrides]).data)

    with pytest.raises(ConfigError, match=r"latin1.txt.*UnicodeDecodeError.*must be UTF-8"):
        load("data.path=text", f"data.data_files={latin1}")
    with pytest.raises(ConfigError, match=r"empty.txt'? is empty: no rows to read"):
        load("data.path=text", f"data.data_files={empty}")
    with pytest.raises(
        ConfigError, match=rf"is a file; .* data.path=text data.data_files={latin1}"
    ):
        load(f"data.path={latin1}")


@pytest.mark.launches
@pytest.mark.parametrize(
    "args,fragment",
    [
        (
            ["cp=6"],
            "cp=6: the config group cp has no option '6'; its options are 1, 2, 4, 8; cp.size=6",
        ),
        (["-m", "cp=1,6"], "cp=6: the config group cp has no option '6'"),
        (["model=huge"], "model=huge: the config group model has no option 'huge'; its options"),
    ],
)
def test_a_missing_group_option_exits_2_with_the_options(tmp_path, args, fragment):
    """Hydra's own error for `cp=6` exited 1 and did not point at cp.size=6."""
    from tests.helpers.cli import run_train_cli

    result = run_train_cli(args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert f"config error: {fragment}" in result.stderr


def test_group_choices_leave_what_hydra_owns_alone():
    from recipe.launch.overrides import check_group_choices
    from tests.helpers.config import CONF_DIR

    conf = Path(CONF_DIR)
    for args in (
        ["hydra/job_logging=disabled"],
        ["cp.size=8"],
        ["cp='1','2'"],
        ["model=small", "data=pydoc"],
    ):
        assert check_group_choices(args, conf) is None, args


@pytest.mark.launches
def test_a_signalled_self_launched_job_exits_with_the_convention_and_one_line(tmp_path):
    """SIGTERM/SIGINT of a cp=2 job exited 1 with a 47-line traceback (cp=1: 143/130). SIGINT
    takes the same path (torch elastic's SignalException) and exits 130."""
    signum, code = signal.SIGTERM, 143
    run_dir = tmp_path / "run"
    job = start_train_cli(["cp=2", "trainer.max_steps=500"], run_dir)
    try:
        wait_for_steps(job, run_dir, 2)
        job.send_signal(signum)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == code
    assert "Traceback" not in stderr
    assert f"stopped by {signal.Signals(signum).name}; the ranks were ended" in stderr
    assert not _rank_processes(job.pid)


@pytest.mark.launches
def test_ctrl_c_in_a_sweep_of_lone_processes_is_one_line_and_exit_130(tmp_path):
    """SIGINT to a cp=1 sweep printed a 136-line KeyboardInterrupt traceback (exit 130 was
    right); a lone run took the same path."""
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["WANDB_MODE"] = "disabled"
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, "trainer.max_steps=500"]
        + [f"hydra.sweep.dir={sweep}", "-m"],
        env=env,
        # a shell that starts jobs in the background hands them SIGINT ignored, and the job would
        # inherit that (it did in a CI run started with `&`): Ctrl-C reaches a foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_steps(job, sweep / "0", 2)
        job.send_signal(signal.SIGINT)
        out, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130, stderr[-3000:] + out[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "interrupted (SIGINT): stopped at once, without a checkpoint; no checkpoint was " in (
        stderr
    )


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc").exists(), reason="finds rank processes through /proc")
def test_a_signal_to_one_rank_ends_the_job_like_a_signal_to_the_parent(tmp_path):
    """SIGUSR1 to rank 1 alone: every rank stops at the step boundary with a checkpoint, and the
    job exits 138 with the line that says how to continue (it was "rank 0 failed", exit 1)."""
    run_dir = tmp_path / "run"
    job = start_train_cli(["cp=2", "trainer.max_steps=500"], run_dir)
    try:
        wait_for_steps(job, run_dir, 2)
        ranks = _rank_processes(job.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGUSR1)
        _, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGUSR1, stderr[-3000:]
    assert "stopped by SIGUSR1; a rank was sent it" in stderr
    assert f"continue with trainer.resume=auto hydra.run.dir={run_dir}" in stderr
    assert "rank 0 failed" not in stderr and "rank 1 failed" not in stderr
