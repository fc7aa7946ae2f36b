"""Hydra launchers for sweeps through submitit: each job gets the tasks its own world needs.

hydra/launcher=slurm submits one SLURM job array per world size of the sweep, each job with
tp*cp*dp tasks and one GPU per task (recipe/launch/sweep_jobs.py sizes them); its tasks are the
job's ranks (recipe/environment.py reads them). hydra/launcher=local_tasks runs the same
path on this machine with submitit's local executor, no SLURM needed: that is how it is tested.
In each job only task 0 writes Hydra's files and logs; the other tasks share its directory.

Hydra loads launchers only from the hydra_plugins namespace, and scans every module there on
every start: without the optional extra (pip install -e ".[slurm]") this module defines nothing,
and train.py names the extra when one of these launchers is asked for.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
except ImportError:  # the slurm extra is not installed
    BaseSubmititLauncher = None

if BaseSubmititLauncher is not None:
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, filter_overrides
    from omegaconf import OmegaConf

    from recipe.errors import ConfigError
    from recipe.launch.overrides import QUIET_HYDRA_OUTPUTS
    from recipe.launch.sweep_jobs import group_by_world_size, job_resources

    log = logging.getLogger(__name__)

    # Settings that size a job's world per job, not per sweep (none of them reaches submitit as is).
    _PER_JOB = ("nodes", "tasks_per_node", "gpus_per_node")
    # submitit takes these when the executor is made, not with the other parameters.
    _AT_CREATION = ("max_num_timeout", "python")

    class _WorldSizedLauncher(BaseSubmititLauncher):
        def __init__(self, max_tasks_per_node: int = 8, gpus_per_rank: int = 1, **params) -> None:
            for key in _PER_JOB:
                if params.pop(key, None) is not None:
                    raise ConfigError(
                        f"hydra.launcher.{key} is set per job from tp*cp*dp by this launcher; "
                        "remove it (hydra.launcher.max_tasks_per_node and gpus_per_rank shape "
                        "the jobs)"
                    )
            super().__init__(**params)
            self.max_tasks_per_node = max_tasks_per_node
            self.gpus_per_rank = gpus_per_rank

        def _world_size(self, overrides: Sequence[str]) -> int:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            return int(cfg.parallel.tp) * int(cfg.cp.size) * int(cfg.parallel.dp)

        def _executor(self):
            import submitit

            params = dict(self.params)
            created = {"folder": params.pop("submitit_folder")}
            for key in _AT_CREATION:
                if params.get(key) is not None:
                    created[f"{self._EXECUTOR}_{key}"] = params.pop(key)
                params.pop(key, None)
            executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **created)
            shared = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(
                **{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()}
            )
            return executor

        def launch(
            self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
        ) -> Sequence[JobReturn]:
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            try:
                worlds = [self._world_size(overrides) for overrides in job_overrides]
                sizes = {
                    w: job_resources(w, self.max_tasks_per_node, self.gpus_per_rank) for w in worlds
                }
            except ConfigError as err:
                print(f"config error: {err}", file=sys.stderr)
                raise SystemExit(2) from None
            executor = self._executor()
            log.info(f"Submitit '{self._EXECUTOR}' sweep output dir: {sweep_dir}")
            submitted = []
            for world, positions in group_by_world_size(worlds).items():
                executor.update_parameters(**sizes[world])
                arguments = []
                for position in positions:
                    num = initial_job_idx + position
                    shown = " ".join(filter_overrides(job_overrides[position]))
                    log.info(f"\t#{num} : {shown} ({world} task{'s' * (world > 1)})")
                    arguments.append(
                        (
                            list(job_overrides[position]),
                            "hydra.sweep.dir",
                            num,
                            f"job_id_for_{num}",
                            Singleton.get_state(),
                        )
                    )
                jobs = executor.map_array(self, *zip(*arguments))
                submitted += zip(positions, jobs)
            returns: list[JobReturn | None] = [None] * len(job_overrides)
            for position, job in submitted:
                returns[position] = job.results()[0]  # task 0's: the one that wrote the job's files
            return returns

        def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
            import submitit

            if submitit.JobEnvironment().global_rank != 0:
                sweep_overrides = [*sweep_overrides, *QUIET_HYDRA_OUTPUTS]
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)

    class SlurmSweepLauncher(_WorldSizedLauncher):
        """hydra/launcher=slurm: one SLURM job array per world size of the sweep."""

        _EXECUTOR = "slurm"

    class LocalSweepLauncher(_WorldSizedLauncher):
        """hydra/launcher=local_tasks: the same jobs as processes of this machine."""

        _EXECUTOR = "local"
