"""The pure parallel layout and the launcher-environment reader, without any process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.config.layout import ParallelDims
from recipe.environment import adopt_environment, port_for_job, read_environment
from recipe.errors import ConfigError

dims_st = st.builds(
    ParallelDims,
    tp=st.sampled_from([1, 2, 4]),
    cp=st.integers(min_value=1, max_value=8),
    dp=st.integers(min_value=1, max_value=8),
)


@settings(max_examples=60, deadline=None)
@given(dims=dims_st)
def test_every_rank_has_one_place_in_the_grid(dims):
    places = {
        (lay.tp_rank, lay.cp_rank, lay.dp_rank)
        for lay in (dims.layout_of(r) for r in range(dims.world_size))
    }
    grid = {(t, c, d) for t in range(dims.tp) for c in range(dims.cp) for d in range(dims.dp)}
    assert places == grid


@pytest.mark.stack_dependent
@settings(max_examples=60, deadline=None)
@given(dims=dims_st)
def test_groups_match_megatron_rank_generator(dims):
    """megatron's own (pure) rank generator is the reference for who shares a cp or dp group."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=dims.tp, ep=1, dp=dims.dp, pp=1, cp=dims.cp, order="tp-cp-ep-dp-pp")
    for mode, coordinate in (("cp", "cp_rank"), ("dp", "dp_rank"), ("tp", "tp_rank")):
        for group in gen.get_ranks(mode):
            layouts = [dims.layout_of(r) for r in group]
            # Within a group only this coordinate varies, and it counts 0, 1, ... in rank order.
            assert [getattr(lay, coordinate) for lay in layouts] == list(range(len(group)))
            others = {
                tuple(getattr(lay, c) for c in ("tp_rank", "cp_rank", "dp_rank") if c != coordinate)
                for lay in layouts
            }
            assert len(others) == 1


def test_alignment_and_world_size():
    assert ParallelDims().alignment == 1
    assert ParallelDims(cp=2).alignment == 4
    assert ParallelDims(cp=4, dp=2).alignment == 8
    assert ParallelDims(cp=4, dp=2).world_size == 8


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"cp": 0}, "cp.size must be > 0"),
        ({"dp": 0}, "parallel.dp must be > 0"),
        ({"tp": 3}, "parallel.tp=3 is not supported; use one of 1, 2, 4"),
    ],
)
def test_bad_degrees_name_the_config_field(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ParallelDims(**kwargs)


def test_a_launched_world_of_the_wrong_size_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"started 3 ranks but tp\*cp\*dp = 1\*2\*2 = 4"):
        ParallelDims(cp=2, dp=2).check_world_size(3)
    ParallelDims(cp=2, dp=2).check_world_size(4)


def test_layout_of_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="outside a world of 2"):
        ParallelDims(cp=2).layout_of(2)


def test_environment_reader_for_each_launcher():
    lone = read_environment({})
    assert (lone.launcher, lone.rank, lone.world_size, lone.external) == ("none", 0, 1, False)
    assert lone.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    torchrun = read_environment(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    )
    assert (torchrun.launcher, torchrun.rank, torchrun.local_rank) == ("torchrun", 3, 1)
    assert (torchrun.world_size, torchrun.local_world_size) == (8, 2)
    slurm = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)",
    }
    assert read_environment(slurm).launcher == "none", "SLURM without MASTER_ADDR: no rendezvous"
    env = read_environment({**slurm, "MASTER_ADDR": "node1"})
    assert (env.launcher, env.rank, env.local_rank, env.world_size) == ("slurm", 5, 1, 16)
    assert env.local_world_size == 8


def test_adopting_slurm_exports_torch_distributed_variables():
    environ = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "4",
        "MASTER_ADDR": "node1",
        "SLURM_JOB_ID": "1234",
    }
    env = adopt_environment(environ)
    assert env.launcher == "slurm"
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("2", "4", "0")
    # The port follows the job id (two jobs on one node never share one), as train.sbatch's.
    assert environ["MASTER_PORT"] == str(port_for_job("1234")) == "11234"
    assert read_environment(environ).rank == 2, "the exported variables say the same"
