"""The one reader of the launcher environment: torchrun, SLURM, submitit, or a lone process.

torchrun (and the recipe's own launcher) set RANK/WORLD_SIZE/LOCAL_RANK; under SLURM the job
script sets MASTER_ADDR and each task knows itself from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID;
a submitit job of several tasks (hydra/launcher=slurm) knows itself from SLURM's variables or,
on one machine, from submitit's own, and nobody sets MASTER_ADDR there: the rendezvous host is
the job's first node and the port follows from the job id, so every task derives the same pair.
Anything else is a lone process that may start its own ranks. `read_environment` is pure (it
takes the mapping), `adopt_environment` also exports the answer in torch.distributed's variables
so an env:// rendezvous works. The compute device follows from the local rank and the GPUs this
process sees, here and only here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from recipe.errors import ConfigError

LAUNCHERS = ("none", "torchrun", "slurm", "submitit")

# Ports derived from a job id stay below Linux's ephemeral range (32768-60999), so an outgoing
# connection of another program cannot already hold the port, and two jobs sharing a node differ.
JOB_PORT_BASE = 10000
JOB_PORT_SPAN = 20000

# submitit names the variables of its two executors differently; the meaning is the same.
_SUBMITIT_VARIABLES = {
    "slurm": {
        "rank": "SLURM_PROCID",
        "local_rank": "SLURM_LOCALID",
        "tasks": "SLURM_NTASKS",
        "nodes": "SLURM_JOB_NUM_NODES",
        "job_id": "SLURM_JOB_ID",
    },
    "local": {
        "rank": "SUBMITIT_LOCAL_GLOBALID",
        "local_rank": "SUBMITIT_LOCAL_LOCALID",
        "tasks": "SUBMITIT_LOCAL_NTASKS",
        "nodes": "SUBMITIT_LOCAL_JOB_NUM_NODES",
        "job_id": "SUBMITIT_LOCAL_JOB_ID",
    },
}


@dataclass(frozen=True)
class ProcessEnvironment:
    """Who this process is, as its launcher says."""

    launcher: str
    """none (a lone process) | torchrun (RANK/WORLD_SIZE set) | slurm (SLURM task + MASTER_ADDR)
    | submitit (a task of a multi-task submitit job)."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int = 1
    master_addr: str | None = None
    """Where rank 0 listens, when the recipe (not the launcher) must tell torch.distributed."""
    master_port: int | None = None

    @property
    def external(self) -> bool:
        """Ranks already exist: the job must join them rather than start its own."""
        return self.launcher != "none"

    @property
    def device(self):
        """The device this process computes on (see compute_device)."""
        return compute_device(self.local_rank, self.local_world_size)


def port_for_job(job_id: str | int) -> int:
    """The rendezvous port of a job: the same on every task of it, different for the next job.
    scripts/slurm/train.sbatch computes the same number in bash."""
    digits = "".join(c for c in str(job_id) if c.isdigit())
    if not digits:
        raise ConfigError(f"job id {job_id!r} has no digits to derive a rendezvous port from")
    return JOB_PORT_BASE + int(digits) % JOB_PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[003-005,9],cpu1` -> `gpu003` (zero padding
    kept), as `scontrol show hostnames | head -n 1` prints it."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first comma outside brackets ends the first group
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    group = nodelist[:end].strip()
    if "[" not in group:
        return group
    prefix, rest = group.split("[", 1)
    ranges, suffix = rest.split("]", 1)
    first = ranges.split(",")[0].split("-")[0]
    return first_host(f"{prefix}{first}{suffix}")


def _tasks_per_node(value: str, world_size: int) -> int:
    # SLURM writes e.g. "8" or "8(x2)"; the leading count is this node's.
    digits = value.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else world_size


def _read_submitit(environ: Mapping[str, str]) -> ProcessEnvironment | None:
    """A task of a submitit job with several tasks; None for anything else (a one-task job is a
    lone process that starts its own ranks, as on a workstation)."""
    names = _SUBMITIT_VARIABLES.get(environ.get("SUBMITIT_EXECUTOR", ""))
    if names is None or int(environ.get(names["tasks"], "1")) <= 1:
        return None
    world = int(environ[names["tasks"]])
    nodes = int(environ.get(names["nodes"], "1"))
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif environ["SUBMITIT_EXECUTOR"] == "slurm":
        addr = first_host(environ.get("SLURM_JOB_NODELIST", "localhost"))
    else:
        addr = "127.0.0.1"
    port = int(environ.get("MASTER_PORT") or port_for_job(environ.get(names["job_id"], "0")))
    return ProcessEnvironment(
        launcher="submitit",
        rank=int(environ[names["rank"]]),
        local_rank=int(environ.get(names["local_rank"], "0")),
        world_size=world,
        local_world_size=_tasks_per_node(environ.get("SLURM_NTASKS_PER_NODE", ""), world // nodes),
        num_nodes=nodes,
        master_addr=addr,
        master_port=port,
    )


def read_environment(environ: Mapping[str, str]) -> ProcessEnvironment:
    """Rank, local rank, world and local world of this process, from `environ` alone."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        world = int(environ["WORLD_SIZE"])
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
        return ProcessEnvironment(
            launcher="torchrun",
            rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=local_world,
            num_nodes=max(1, world // max(1, local_world)),
        )
    submitit = _read_submitit(environ)
    if submitit is not None:
        return submitit
    # A batch script or salloc shell carries SLURM_PROCID too; only MASTER_ADDR, which
    # train.sbatch exports before srun, says that the tasks of a step are the ranks.
    if "SLURM_PROCID" in environ and "MASTER_ADDR" in environ:
        world = int(environ.get("SLURM_NTASKS", "1"))
        port = environ.get("MASTER_PORT") or port_for_job(environ.get("SLURM_JOB_ID", "0"))
        return ProcessEnvironment(
            launcher="slurm",
            rank=int(environ["SLURM_PROCID"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            world_size=world,
            local_world_size=_tasks_per_node(environ.get("SLURM_NTASKS_PER_NODE", ""), world),
            num_nodes=int(environ.get("SLURM_JOB_NUM_NODES", "1")),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(port),
        )
    return ProcessEnvironment("none", rank=0, local_rank=0, world_size=1, local_world_size=1)


def launched_run_name(environ: Mapping[str, str]) -> str | None:
    """A name every rank of a launched world reads alike from its launcher, for the one run
    directory they share (`torchrun/<run id>`, `slurm/<job>.<step>`, `submitit/<job>`); None
    for a lone process, or a launcher that names its runs nowhere the ranks can read."""
    env = read_environment(environ)
    if env.launcher == "torchrun":
        run_id = environ.get("TORCHELASTIC_RUN_ID")
        return f"torchrun/{run_id}" if run_id else None
    if env.launcher == "slurm":
        return f"slurm/{environ.get('SLURM_JOB_ID', '0')}.{environ.get('SLURM_STEP_ID', '0')}"
    if env.launcher == "submitit":
        names = _SUBMITIT_VARIABLES[environ["SUBMITIT_EXECUTOR"]]
        return f"submitit/{environ.get(names['job_id'], '0')}"
    return None


_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
_LAUNCHER_PREFIXES = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_")


def lone_process_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without what makes a process a rank of a launched world: for a helper process
    (a noise twin) that a rank starts, which must be a lone process of its own."""
    return {
        key: value
        for key, value in environ.items()
        if key not in _RANK_VARIABLES and not key.startswith(_LAUNCHER_PREFIXES)
    }


def adopt_environment(environ: MutableMapping[str, str] = os.environ) -> ProcessEnvironment:
    """Read the environment; under SLURM or submitit also export it as torch.distributed's
    variables (what a launcher already set is kept)."""
    env = read_environment(environ)
    if env.launcher in ("slurm", "submitit"):
        environ.setdefault("RANK", str(env.rank))
        environ.setdefault("WORLD_SIZE", str(env.world_size))
        environ.setdefault("LOCAL_RANK", str(env.local_rank))
        environ.setdefault("LOCAL_WORLD_SIZE", str(env.local_world_size))
        environ.setdefault("MASTER_ADDR", str(env.master_addr))
        environ.setdefault("MASTER_PORT", str(env.master_port))
    return env


def launched_world_problem(
    env: ProcessEnvironment, tp: int, cp: int, dp: int, pp: int = 1
) -> str | None:
    """Why the world a launcher started cannot run tp x cp x dp (x pp), with the launch that
    would, or None when it fits (a lone process starts its own ranks and always fits)."""
    wanted = tp * cp * dp * pp
    if not env.external or env.world_size == wanted:
        return None
    grid = f"tp*cp*dp = {tp}*{cp}*{dp} = {wanted}"
    if pp > 1:
        grid = f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {wanted}"
    nodes = env.num_nodes if wanted % env.num_nodes == 0 else 1
    per_node = wanted // nodes
    if env.launcher == "slurm":
        fix = (
            f"submit {wanted} tasks, one per GPU: sbatch --nodes={nodes} "
            f"--ntasks-per-node={per_node} --gpus-per-node={per_node} scripts/slurm/train.sbatch"
        )
    elif env.launcher == "submitit":
        fix = "let hydra/launcher=slurm size each job (it sets tasks_per_node to tp*cp*dp)"
    else:
        fix = f"start {wanted} ranks: torchrun --nnodes={nodes} --nproc-per-node={per_node}"
    stale = (
        " (RANK and WORLD_SIZE came from the environment: if no launcher set them, unset them "
        "and the recipe starts its own ranks)"
        if env.launcher == "torchrun"
        else ""
    )
    return (
        f"the {env.launcher} launcher started {env.world_size} ranks but {grid}; {fix}, or "
        f"change cp / parallel.dp to fit the launched world{stale}"
    )


GPU_SHARING_VARIABLE = "RECIPE_GPU_SHARING"
GPU_SHARING_MODES = ("off", "nccl", "gloo")
"""How several ranks share one GPU, a diagnostic for machines with fewer GPUs than ranks
(`scripts/gpu_check.py`'s cp2_one_gpu): off (one rank per GPU, NCCL), nccl (NCCL's own mode for
several ranks per GPU, NCCL >= 2.30, which NCCL_MULTI_RANK_GPU_ENABLE=1 turns on) or gloo
(gloo collectives; the recipe stages the all-gathers gloo cannot run on CUDA through the host).
Never for speed: only to run a CP layout's arithmetic on a GPU where there is one GPU."""


def gpu_sharing(environ: Mapping[str, str] = os.environ) -> str:
    """The GPU-sharing mode the environment asks for (see GPU_SHARING_MODES)."""
    mode = environ.get(GPU_SHARING_VARIABLE, "off") or "off"
    if mode not in GPU_SHARING_MODES:
        raise ConfigError(
            f"{GPU_SHARING_VARIABLE}={mode!r} is not a GPU-sharing mode; use one of "
            f"{', '.join(GPU_SHARING_MODES)} (or leave it unset)"
        )
    return mode


def gpu_index(
    local_rank: int, local_world_size: int, visible_gpus: int, sharing: str = "off"
) -> int:
    """Which of the GPUs this process sees is its own.

    Without per-task binding every rank of a node sees all of them and takes the one of its
    local rank; a site that binds one GPU per task (srun --gpus-per-task=1, --gpu-bind) shows
    each rank only its own, as index 0, whatever its local rank. With GPU sharing on, ranks take
    the visible GPUs in turn.
    """
    if visible_gpus >= local_world_size:
        return local_rank
    if visible_gpus == 1:
        return 0
    if sharing != "off":
        return local_rank % visible_gpus
    raise ConfigError(
        f"local rank {local_rank} of {local_world_size} ranks on this node sees {visible_gpus} "
        "GPUs: give every rank one GPU (srun --gpus-per-task=1) or every rank all of the node's "
        f"(--gpus-per-node={local_world_size}, no per-task binding)"
    )


def cuda_available() -> bool:
    """Whether this process computes on GPUs: the one place the recipe asks (the device, the
    backend, the CPU compatibility patches, the RNG tracker, the launcher's rank limit and
    checkpointed RNG state all follow from it)."""
    import torch

    return torch.cuda.is_available()


def compute_device(local_rank: int, local_world_size: int = 1):
    """The GPU of this local rank where CUDA exists (see gpu_index), else the CPU."""
    import torch

    if cuda_available():
        index = gpu_index(local_rank, local_world_size, torch.cuda.device_count(), gpu_sharing())
        return torch.device("cuda", index)
    return torch.device("cpu")


def collective_backend(device_type: str, sharing: str) -> str:
    """torch.distributed's backend for ranks computing on `device_type`: NCCL on GPUs (also in
    NCCL's own GPU-sharing mode), gloo on the CPU and where GPU sharing asks for gloo."""
    if device_type == "cuda" and sharing != "gloo":
        return "nccl"
    return "gloo"
