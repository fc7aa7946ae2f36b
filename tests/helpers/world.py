"""Worlds for tests: a world of one in this process, and launched worlds kept for the session.

Starting ranks is what a test suite on two cores pays for: every spawned rank imports torch and
megatron-core again (seconds each). `WorldPool` starts one world per world size the first time a
test needs it and keeps it: each job (a function and its arguments, run on every rank) joins the
world that is already up and builds megatron's groups for its own (tp, cp, dp) (`train()` joins
a world it did not create and leaves it up); the rank destroys those groups after the job
(`groups.release_model_parallel`). So a cp=2 job, a tp=2 job and a dp=2 job all run in the same
two processes, one after another.

The ranks are real gloo ranks with torchrun's variables and an env:// rendezvous on loopback,
started on a CPU as forks of a server that has imported torch, megatron-core and the trainer
once; `python train.py cp=2`'s own launch path stays covered by the CLI tests. A job that
fails on any rank ends that world (its traceback comes back in `WorldFailed`); the next job of
that size starts a fresh one.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from pathlib import Path

from recipe.launch.local import LOST_PEER_MARKERS, lone_world

__all__ = ["WorldFailed", "WorldPool", "lone_world"]

_POLL_S = 0.02
_STOP = "stop"


# What a rank imports before its first job: the fork server imports them once for every world.
_PRELOADED = ["torch", "megatron.core", "recipe.training.trainer"]


def _start_method() -> str:
    """forkserver on a CPU: a world of 4 on 2 cores starts in about half the time (measured with
    the recipe's launcher, cp=4 and 2 steps: 28 s by spawn, 15 s from a fork server). The
    recipe's own launcher keeps spawn: torch's elastic agent reports only the first rank exit it
    notices, and from a fork server that was the rank that lost its peer, not the one that
    failed (tests/test_launch.py); the pool reads every rank's error itself. With GPUs: spawn,
    so that no CUDA state can be inherited through a fork."""
    import multiprocessing

    import torch

    if torch.cuda.is_available():
        return "spawn"
    multiprocessing.set_forkserver_preload(_PRELOADED)
    return "forkserver"


class WorldFailed(RuntimeError):
    """A job failed on a rank of a pooled world (the message carries that rank's traceback)."""


def _atomic_write(path: Path, payload: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(payload)
    os.replace(partial, path)


def _serve(local_rank: int, world_size: int, port: int, root: str) -> None:
    """A rank of a pooled world: run job after job from `root`, rank 0 writing each result."""
    from datetime import timedelta

    root_dir = Path(root)
    log = os.open(root_dir / f"rank{local_rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WANDB_MODE="disabled",
    )
    import torch.distributed as dist

    from recipe.log import quiet_libraries
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.parallel import groups

    quiet_libraries()
    install_cpu_patches()
    # The world waits between jobs as long as a test session may take; each job's own groups
    # carry the job's collective timeout.
    dist.init_process_group("gloo", timeout=timedelta(hours=3))
    number = 0
    while True:
        job_file = root_dir / f"job{number}.pkl"
        while not job_file.exists():
            time.sleep(_POLL_S)
        job = pickle.loads(job_file.read_bytes())
        if job == _STOP:
            break
        function, args = job
        try:
            result = function(*args)
        except BaseException:
            _atomic_write(
                root_dir / f"error{number}.rank{local_rank}.txt", traceback.format_exc().encode()
            )
            raise
        finally:
            groups.release_model_parallel()
        if local_rank == 0:
            _atomic_write(root_dir / f"result{number}.pkl", pickle.dumps(result))
        number += 1
    dist.destroy_process_group()


class _World:
    """One running world: its processes, its job directory and the next job's number."""

    def __init__(self, world_size: int, root: Path):
        import torch.multiprocessing as mp

        from recipe.parallel.groups import _free_port

        self.size = world_size
        self.root = root
        root.mkdir(parents=True)
        self.context = mp.start_processes(
            _serve,
            args=(world_size, _free_port(), str(root)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        self.jobs = 0

    def run(self, function, args: tuple, timeout_s: float):
        number = self.jobs
        self.jobs += 1
        _atomic_write(self.root / f"job{number}.pkl", pickle.dumps((function, args)))
        result = self.root / f"result{number}.pkl"
        deadline = time.monotonic() + timeout_s
        while not result.exists():
            failed = sorted(self.root.glob(f"error{number}.rank*.txt"))
            if failed or not all(p.is_alive() for p in self.context.processes):
                self.close(grace_s=2)
                raise WorldFailed(self._failure(number, failed))
            if time.monotonic() > deadline:
                self.close(grace_s=0)
                raise WorldFailed(
                    f"job {number} ({function.__qualname__}) did not finish in {timeout_s:.0f} s "
                    f"on the world of {self.size}; its ranks were ended.\n{self._log_tail()}"
                )
            time.sleep(_POLL_S)
        return pickle.loads(result.read_bytes())

    def _failure(self, number: int, failed: list[Path]) -> str:
        time.sleep(0.5)  # let the root failure's rank finish writing before choosing
        failed = sorted(self.root.glob(f"error{number}.rank*.txt")) or failed
        if not failed:
            return f"a rank of the world of {self.size} died without a traceback.\n" + (
                self._log_tail()
            )
        texts = [(p.name, p.read_text()) for p in failed]
        # A rank that failed only because a peer died reports a lost connection: the peer first.
        texts.sort(key=lambda item: any(marker in item[1] for marker in LOST_PEER_MARKERS))
        name, text = texts[0]
        return f"{name} (world of {self.size}):\n{text}"

    def _log_tail(self, chars: int = 3000) -> str:
        logs = sorted(self.root.glob("rank*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text()[-chars:]}" for p in logs)

    def close(self, grace_s: float = 30) -> None:
        alive = [p for p in self.context.processes if p.is_alive()]
        if alive and grace_s > 0:
            _atomic_write(self.root / f"job{self.jobs}.pkl", pickle.dumps(_STOP))
            deadline = time.monotonic() + grace_s
            while any(p.is_alive() for p in alive) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
        for process in self.context.processes:
            if process.is_alive():
                process.kill()
            process.join()


class WorldPool:
    """Launched worlds kept across tests, one per world size (see the module docstring)."""

    def __init__(self, root: Path, timeout_s: float = 600):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self._worlds: dict[int, _World] = {}
        self._started = 0

    def run(self, world_size: int, function, *args):
        """`function(*args)` on every rank of a world of `world_size`; rank 0's result. A world
        of one is this process (as `python train.py` at cp=1 runs: no ranks are started)."""
        if world_size == 1:
            return function(*args)
        world = self._worlds.get(world_size)
        if world is None:
            self._started += 1
            world = _World(world_size, self.root / f"world{world_size}-{self._started}")
            self._worlds[world_size] = world
        try:
            return world.run(function, args, self.timeout_s)
        except WorldFailed:
            del self._worlds[world_size]
            raise

    def train(self, cfg) -> dict:
        """`train(cfg)` on a world of cfg.world_size; rank 0's {"summary", "history"}."""
        from recipe.launch.rank import train

        return self.run(cfg.world_size, train, cfg)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close(grace_s=0)  # idle between jobs: nothing is lost
        self._worlds.clear()
