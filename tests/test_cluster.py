"""On a cluster: SLURM's and submitit's environments, train.sbatch, sweeps through submitit, and a
world of two torchrun agents. No SLURM here: train.sbatch runs under a stand-in `srun` that starts
the tasks on this machine, and the submitit sweeps use submitit's local executor."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from recipe.compare.diff import compare
from recipe.compare.runs import load_run
from recipe.config import ConfigError
from recipe.environment import (
    collective_backend,
    first_host,
    gpu_index,
    gpu_sharing,
    launched_world_problem,
    port_for_job,
    read_environment,
)
from recipe.parallel.collectives import needs_host_staging
from recipe.rundir.metrics import effective_records, read_metrics
from tests.helpers.cli import RANK_VARIABLES, run_train_cli
from tests.helpers.config import ROOT, TINY

RTOL = 1e-5
STEPS = 3


def _clean_env(**extra) -> dict[str, str]:
    """This environment without any launcher's variables (and wandb off), plus `extra`."""
    launcher = ("SLURM_", "SUBMITIT_")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in RANK_VARIABLES and not k.startswith(launcher)
    }
    env["WANDB_MODE"] = "disabled"
    env.update(extra)
    return env


def _steps(run_dir: Path) -> list[int]:
    return [record["step"] for record in effective_records(read_metrics(run_dir))]


# --- the environment reader: pure -----------------------------------------------------------


def test_a_multi_task_submitit_job_is_a_world_with_a_derived_rendezvous():
    slurm_task = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[007-008]",
        "SLURM_JOB_ID": "123456",
    }
    env = read_environment(slurm_task)
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("submitit", 5, 1, 8)
    assert (env.local_world_size, env.num_nodes) == (4, 2)
    assert (env.master_addr, env.master_port) == ("gpu007", port_for_job("123456"))
    local_task = {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_GLOBALID": "1",
        "SUBMITIT_LOCAL_LOCALID": "1",
        "SUBMITIT_LOCAL_NTASKS": "2",
        "SUBMITIT_LOCAL_JOB_ID": "4321",
    }
    env = read_environment(local_task)
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "127.0.0.1")
    # One task: a lone process that starts its own ranks (hydra/launcher=submitit_local). A batch
    # shell with SLURM's variables but no MASTER_ADDR is not a world either.
    one = {**local_task, "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_GLOBALID": "0"}
    assert not read_environment(one).external
    assert not read_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).external


def test_slurm_node_lists_ports_and_gpus_under_per_task_binding():
    assert first_host("gpu[003-005,9],cpu1") == "gpu003"
    assert first_host("node7,node8") == "node7"
    assert first_host("rack[2-3]-n[10-11]") == "rack2-n10"
    assert port_for_job(4242) == port_for_job("4242") != port_for_job(4243)
    assert all(10000 <= port_for_job(j) < 30000 for j in (1, 29999, 10**9))
    # No binding: every rank sees all 8 GPUs and takes its local rank's; one GPU per task: 0.
    assert [gpu_index(r, 8, visible_gpus=8) for r in (0, 5)] == [0, 5]
    assert [gpu_index(r, 8, visible_gpus=1) for r in (0, 5)] == [0, 0]
    with pytest.raises(ConfigError, match=r"sees 2 GPUs: give every rank one GPU"):
        gpu_index(3, 4, visible_gpus=2)


def test_gpu_sharing_places_ranks_in_turn_and_picks_the_collective_backend():
    """GPU sharing (scripts/gpu_check.py's cp2_one_gpu): ranks take the GPUs in turn; NCCL stays
    the backend in NCCL's own sharing mode, gloo where asked, gloo on the CPU always."""
    assert [gpu_index(r, 4, visible_gpus=2, sharing="gloo") for r in range(4)] == [0, 1, 0, 1]
    assert gpu_sharing({}) == "off"
    assert gpu_sharing({"RECIPE_GPU_SHARING": "nccl"}) == "nccl"
    with pytest.raises(ConfigError, match=r"RECIPE_GPU_SHARING='ncl' is not .* off, nccl, gloo"):
        gpu_sharing({"RECIPE_GPU_SHARING": "ncl"})
    assert collective_backend("cuda", "off") == collective_backend("cuda", "nccl") == "nccl"
    assert collective_backend("cuda", "gloo") == collective_backend("cpu", "off") == "gloo"
    # gloo all-gathers only CPU tensors: CUDA ones on a gloo group go through the host
    assert needs_host_staging("cuda", "gloo")
    assert not needs_host_staging("cuda", "nccl") and not needs_host_staging("cpu", "gloo")


def test_determinism_switches_both_ways(monkeypatch):
    """A job without determinism after one with it (gpu_check's parts, a multirun) must give
    Transformer Engine its non-deterministic kernels back."""
    import torch

    from recipe.model.numerics import apply_determinism

    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        apply_determinism(True)
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
        assert torch.are_deterministic_algorithms_enabled()
        apply_determinism(False)
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "1"
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before, warn_only=True)


def test_a_launched_world_of_the_wrong_size_names_the_launch_that_fits():
    slurm = read_environment(
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "MASTER_ADDR": "n1", "SLURM_JOB_ID": "9"}
    )
    message = launched_world_problem(slurm, tp=1, cp=4, dp=1)
    assert "the slurm launcher started 3 ranks but tp*cp*dp = 1*4*1 = 4" in message
    assert "sbatch --nodes=1 --ntasks-per-node=4 --gpus-per-node=4" in message
    torchrun = read_environment({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})
    assert "torchrun --nnodes=2 --nproc-per-node=2" in launched_world_problem(torchrun, 1, 4, 1)
    assert launched_world_problem(slurm, tp=1, cp=1, dp=3) is None
    assert launched_world_problem(read_environment({}), 1, 4, 1) is None, "a lone process fits"


def test_sweep_jobs_get_the_tasks_of_their_own_world():
    from recipe.launch.sweep_jobs import group_by_world_size, job_resources

    assert group_by_world_size([1, 2, 4, 1, 2, 4]) == {1: [0, 3], 2: [1, 4], 4: [2, 5]}
    assert job_resources(4, 8, 1) == {"nodes": 1, "tasks_per_node": 4, "gpus_per_node": 4}
    assert job_resources(16, 8, 1) == {"nodes": 2, "tasks_per_node": 8, "gpus_per_node": 16 // 2}
    assert job_resources(12, 8, 1)["tasks_per_node"] == 6, "equal tasks on every node"
    assert job_resources(2, 64, 0) == {"nodes": 1, "tasks_per_node": 2}, "CPU: no GPUs asked"


# --- train.sbatch under a stand-in srun -----------------------------------------------------

FAKE_SRUN = r"""#!/bin/bash
# Records its options, then starts SLURM_NTASKS copies of the command as SLURM tasks would run.
options=()
while [[ "$1" == --* ]]; do options+=("$1"); shift; done
printf '%s\n' "${options[@]}" > "$SRUN_RECORD"
[[ -n "${SRUN_DRY:-}" ]] && exit 0
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS_PER_NODE=$SLURM_NTASKS "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def _stand_ins(bin_dir: Path) -> None:
    bin_dir.mkdir()
    scripts = {
        "srun": FAKE_SRUN,
        "scontrol": '#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && echo 127.0.0.1\n',
        "python": f'#!/bin/bash\nexec "{sys.executable}" "$@"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)


def _sbatch(tmp_path: Path, args: list[str], **extra) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        _stand_ins(bin_dir)
    env = _clean_env(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_JOB_NUM_NODES="1",
        SRUN_RECORD=str(tmp_path / "srun_options.txt"),
        RUN_DIR=str(tmp_path / "run"),
        **extra,
    )
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *TINY, *args],
        cwd=ROOT,  # sbatch is submitted from the repository root
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.distributed
def test_sbatch_script_trains_one_world_in_one_run_directory(tmp_path):
    result = _sbatch(tmp_path, ["cp=2", f"trainer.max_steps={STEPS}"])
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    assert _steps(run) == [1, 2, 3], "rank 0 alone writes metrics"
    assert len(list(tmp_path.rglob(".hydra"))) == 1 and not (ROOT / ".hydra").exists()
    shards = sorted(p.name for p in (run / "checkpoints").rglob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], "every rank's shard in the run directory"
    assert not (ROOT / "checkpoints").exists()
    log = (run / "train.log").read_text()
    port = port_for_job(4242)
    assert "joining a world of 2 ranks started outside the recipe (RANK=0 WORLD_SIZE=2 " in log
    assert f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in log, "port derived from the job id"
    options = (tmp_path / "srun_options.txt").read_text().split()
    assert "--kill-on-bad-exit=1" in options
    assert not any(o.startswith("--container") for o in options), "no IMAGE: no container"
    dry = _sbatch(tmp_path, ["cp=2"], IMAGE="/images/cp-recipe.sqsh", SRUN_DRY="1")
    assert dry.returncode == 0, dry.stderr
    options = (tmp_path / "srun_options.txt").read_text().split()
    assert "--container-image=/images/cp-recipe.sqsh" in options
    assert "--container-workdir=/opt/recipe" in options


@pytest.mark.launches
def test_a_slurm_allocation_of_the_wrong_size_is_refused_with_the_sbatch_flags(tmp_path):
    env = _clean_env(
        SLURM_PROCID="0",
        SLURM_NTASKS="3",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID="77",
        MASTER_ADDR="127.0.0.1",
    )
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *TINY, "cp=2", f"hydra.run.dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    host = socket.gethostname()
    assert f"rank 0 on {host}: config error: the slurm launcher started 3 ranks" in result.stderr
    assert "sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=2" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# --- sweeps through submitit ----------------------------------------------------------------


@pytest.mark.launches
def test_a_submitit_launcher_without_the_plugin_names_the_extra(tmp_path):
    # A regular package named hydra_plugins, first on the path, hides the installed namespace.
    (tmp_path / "hydra_plugins").mkdir()
    (tmp_path / "hydra_plugins" / "__init__.py").write_text("")
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", "hydra/launcher=slurm"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert (
        "config error: hydra/launcher=slurm needs hydra-submitit-launcher, which is not "
        'installed: pip install -e ".[slurm]"'
    ) in result.stderr
    assert not (tmp_path / "multirun").exists()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "launcher, tasks_of_cp2",
    [("submitit_local", 1), ("local_tasks", 2)],
    ids=["one-process-per-job", "one-task-per-rank"],
)
def test_a_submitit_sweep_ends_in_a_passing_parity_report(tmp_path, launcher, tasks_of_cp2):
    """submitit_local: each job one process that starts its own ranks. local_tasks: the path of
    hydra/launcher=slurm, each job tp*cp*dp tasks that are its ranks. Either way the report is
    written by the submitting process, from what the jobs recorded in their own processes."""
    sweep = tmp_path / "sweep"
    result = run_train_cli(
        [
            f"trainer.max_steps={STEPS}",
            "cp=1,2",
            f"hydra/launcher={launcher}",
            f"hydra.sweep.dir={sweep}",
            "-m",
        ],
        cwd=tmp_path,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-2000:]
    assert [_steps(sweep / job) for job in ("0", "1")] == [[1, 2, 3], [1, 2, 3]]
    report = (sweep / "parity_report.md").read_text()
    assert "| 1: cp=2 | 0 |" in report and "**PASS**" in report and "1 passed, 0 failed" in report
    assert "parity report (all PASS)" in result.stdout, "printed by the submitting process"
    job_folders = {p.parent for p in (sweep / ".submitit").rglob("*_result.pkl")}
    tasks = sorted(len(list(folder.glob("*_result.pkl"))) for folder in job_folders)
    assert tasks == sorted([1, tasks_of_cp2]), "tasks per job"
    assert len(list((sweep / "1").rglob(".hydra"))) == 1, "only task 0 writes Hydra's files"


# --- two torchrun agents, as on two nodes -----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.distributed
def test_two_torchrun_agents_train_cp2_as_cp1_does(tmp_path):
    """`torchrun --nnodes=2 --rdzv-backend=c10d` on each of two "nodes" (here: two agents on
    loopback, one rank each, gloo); the cp=2 world must match cp=1 step by step."""
    run_dir, reference = tmp_path / "cp2", tmp_path / "cp1"
    endpoint = f"127.0.0.1:{_free_port()}"
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=two-nodes",
        str(ROOT / "train.py"),
        *TINY,
        "cp=2",
        f"trainer.max_steps={STEPS}",
        f"hydra.run.dir={run_dir}",  # the same on every node: rank 0 alone creates it
    ]
    alone = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        f"trainer.max_steps={STEPS}",
        f"hydra.run.dir={reference}",
    ]
    jobs = [  # the cp=1 reference runs meanwhile
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in (agent, agent, alone)
    ]
    try:
        outputs = [job.communicate(timeout=300) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    errors = "\n".join(err[-2000:] for _, err in outputs)
    assert [job.returncode for job in jobs] == [0, 0, 0], errors
    assert _steps(run_dir) == [1, 2, 3]
    assert len(list(tmp_path.rglob(".hydra"))) == 2, "one per run, none from rank 1"
    assert {p.parent.parent for p in tmp_path.rglob("__1_0.distcp")} == {run_dir / "checkpoints"}
    result = compare(load_run(run_dir), load_run(reference), rtol=RTOL)
    assert result.passed and result.steps_compared == STEPS, result
    assert {d.metric for d in result.diffs} >= {"lm_loss", "grad_norm"}
