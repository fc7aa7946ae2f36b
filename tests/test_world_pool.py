"""The session's launched worlds (tests/helpers/world.py): jobs of different layouts share the
processes and leave no groups behind; a failing job names the rank that failed and its error, and
the next job gets a fresh world."""

from __future__ import annotations

import pytest

from recipe.config.layout import ParallelDims
from tests.helpers.world import WorldFailed, WorldPool

pytestmark = pytest.mark.distributed


def _layout_job(dims: ParallelDims) -> dict:
    """This rank's pid, its place in the layout, megatron's CP group size, and how many process
    groups exist while the job runs and after it released them."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from recipe.parallel import groups

    with groups.parallel_world(dims) as layout:
        during = len(dist.distributed_c10d._world.pg_map)
        cp_size = parallel_state.get_context_parallel_world_size()
    groups.release_model_parallel()
    return {
        "pid": os.getpid(),
        "place": (layout.tp_rank, layout.cp_rank, layout.dp_rank),
        "cp_size": cp_size,
        "groups_during": during,
        "groups_after": len(dist.distributed_c10d._world.pg_map),
        "megatron_after": parallel_state.model_parallel_is_initialized(),
    }


def _fail_on_rank_1(_) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 loses its peer here


def test_jobs_of_different_layouts_share_one_world_and_release_their_groups(tmp_path):
    pool = WorldPool(tmp_path, timeout_s=300)
    try:
        cp2 = pool.run(2, _layout_job, ParallelDims(cp=2))
        tp2 = pool.run(2, _layout_job, ParallelDims(tp=2))
        dp2 = pool.run(2, _layout_job, ParallelDims(dp=2))
    finally:
        pool.close()
    assert cp2["pid"] == tp2["pid"] == dp2["pid"], "one world of two for all three jobs"
    assert (cp2["place"], tp2["place"], dp2["place"]) == ((0, 0, 0),) * 3  # rank 0's answer
    assert (cp2["cp_size"], tp2["cp_size"], dp2["cp_size"]) == (2, 1, 1)
    for job in (cp2, tp2, dp2):
        assert job["groups_during"] > job["groups_after"] == 1, "only the world is left"
        assert not job["megatron_after"]


def test_a_failing_job_names_the_failed_rank_and_the_next_job_gets_a_fresh_world(tmp_path):
    pool = WorldPool(tmp_path, timeout_s=300)
    try:
        before = pool.run(2, _layout_job, ParallelDims(cp=2))
        with pytest.raises(WorldFailed) as info:
            pool.run(2, _fail_on_rank_1, None)
        after = pool.run(2, _layout_job, ParallelDims(cp=2))
    finally:
        pool.close()
    message = str(info.value)
    assert message.startswith("error1.rank1.txt"), message[:300]
    assert "injected failure on rank 1" in message
    assert after["pid"] != before["pid"], "a fresh world"
    assert after["cp_size"] == 2
