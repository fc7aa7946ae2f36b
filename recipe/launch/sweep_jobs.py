"""How the jobs of a submitit sweep are sized: one task per rank, tp*cp*dp ranks per job.

hydra-submitit-launcher sizes every job of a sweep alike (its resources come from the config as
the sweep starts, before any job's overrides), but `-m experiment=cp_parity` runs worlds of 1, 2
and 4 ranks. The recipe's launchers (hydra_plugins/recipe_launchers, where Hydra requires
launchers to live) group the jobs by world size with these functions and submit one job array per
size.
"""

from __future__ import annotations

from collections.abc import Sequence

from recipe.errors import ConfigError


def job_resources(world_size: int, max_tasks_per_node: int, gpus_per_rank: int) -> dict:
    """Nodes, tasks per node and GPUs per node for a world of `world_size` ranks, one task per
    rank, filling as few nodes as possible with equally many tasks each."""
    if world_size < 1 or max_tasks_per_node < 1:
        raise ConfigError(
            f"a job of {world_size} ranks on nodes of at most {max_tasks_per_node} tasks cannot "
            "be placed; check cp, parallel.* and hydra.launcher.max_tasks_per_node"
        )
    nodes = -(-world_size // max_tasks_per_node)
    while world_size % nodes:  # equal tasks per node: torch.distributed assumes a regular grid
        nodes += 1
    per_node = world_size // nodes
    resources = {"nodes": nodes, "tasks_per_node": per_node}
    if gpus_per_rank:
        resources["gpus_per_node"] = per_node * gpus_per_rank
    return resources


def group_by_world_size(world_sizes: Sequence[int]) -> dict[int, list[int]]:
    """The positions of the jobs of each world size, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for position, world in enumerate(world_sizes):
        groups.setdefault(world, []).append(position)
    return groups
