"""megatron's THD RoPE, vectorised (recipe/megatron/rope.py): the rows of `freqs` each token
takes are megatron's own `_get_thd_freqs_on_this_cp_rank`, the result is megatron's unfused
function's bit for bit at cp 1/2/4 (both `freqs` formats, interleaved or not, and in training
steps with MTP at cp 1 and 2), and a micro-batch's later layers read nothing from the device."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.checks.upstream.kit.layouts import GroupStandIn as _Group
from recipe.megatron.rope import (
    ROPE_MODULE,
    freq_rows,
    install_thd_rope,
    megatron_thd_rope,
    vectorised_thd_rope,
)

rope = importlib.import_module(ROPE_MODULE)


def _bounds(units, cp):
    lengths = [u * 2 * cp for u in units]
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 4]).flatmap(
        lambda cp: st.tuples(
            st.just(cp),
            st.integers(0, cp - 1),
            st.lists(st.integers(1, 5), min_size=1, max_size=6),
            st.booleans(),
        )
    )
)
def test_each_token_takes_megatrons_row_of_freqs(case):
    cp, rank, units, packed = case
    bounds = _bounds(units, cp)
    freqs = torch.arange(bounds[-1] if packed else max(units) * 2 * cp)[:, None, None, None]
    expected = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        x = torch.empty((end - start) // cp)
        offset = start if packed else 0
        expected += (
            rope._get_thd_freqs_on_this_cp_rank(rank, cp, x, freqs, offset).flatten().tolist()
        )
    assert freq_rows(bounds, cp, rank, packed) == expected


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["per_sequence", "packed_freqs"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_result_is_megatrons_bit_for_bit(cp, packed, interleaved):
    generator = torch.Generator().manual_seed(cp)
    units = [3, 1, 4, 2]
    bounds = _bounds(units, cp)
    longest = max(units) * 2 * cp
    freqs = torch.rand(bounds[-1] if packed else longest, 1, 1, 8, generator=generator) * 6
    for rank in range(cp):
        cu = torch.tensor(bounds, dtype=torch.int32)
        t = torch.randn(bounds[-1] // cp, 4, 8, generator=generator)
        group = _Group(cp, rank)
        expected = megatron_thd_rope()(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
        got = vectorised_thd_rope(t, cu, freqs, rotary_interleaved=interleaved, cp_group=group)
        assert torch.equal(got, expected), (cp, rank)


def test_a_micro_batchs_later_layers_read_nothing_from_the_device(monkeypatch):
    cu = torch.tensor(_bounds([3, 1, 2], 2), dtype=torch.int32)
    freqs = torch.rand(12, 1, 1, 8)
    t = torch.randn(int(cu[-1]) // 2, 2, 8)
    first = vectorised_thd_rope(t, cu, freqs, cp_group=_Group(2, 1))

    def host_read(*args, **kwargs):
        raise AssertionError("a host read after the micro-batch's first layer")

    monkeypatch.setattr(torch.Tensor, "tolist", host_read)
    monkeypatch.setattr(torch.Tensor, "item", host_read)
    for _ in range(3):  # the other layers and MTP depths, queries and keys
        assert torch.equal(vectorised_thd_rope(t, cu, freqs, cp_group=_Group(2, 1)), first)


def _steps_on_rank(cfg, patched: bool) -> dict:
    """`cfg.trainer.max_steps` steps on this rank with the vectorised RoPE the model installs,
    or (not patched) with megatron's own unfused THD RoPE; rank 0's records less the timings.
    Leaves megatron's module with the patch, as the model leaves it."""
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.model import gpt
    from tests.helpers.training import rank_trainer, train_records, without_timings

    install_cpu_patches()  # before megatron's RoPE is swapped below
    install = gpt.install_thd_rope
    if not patched:
        rope._apply_rotary_pos_emb_thd = megatron_thd_rope()
        gpt.install_thd_rope = lambda: None
    try:
        with rank_trainer(cfg) as trainer:
            installed = rope._apply_rotary_pos_emb_thd is vectorised_thd_rope
            records = train_records(trainer, cfg.trainer.max_steps)
    finally:
        gpt.install_thd_rope = install
        install_thd_rope()
    return {"installed": installed, "records": without_timings(records)}


@pytest.mark.stack_dependent  # against megatron's own RoPE, of each release
@pytest.mark.parametrize("cp", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_the_model_installs_it_and_a_training_step_is_megatrons_bit_for_bit(cp, worlds):
    """Steps with MTP (RoPE in every layer and depth) with the patch and with megatron's own, in
    this process and on two CP ranks (each rank's own rows of freqs)."""
    from tests.helpers.config import typed_config

    cfg = typed_config(["trainer.max_steps=2", "mtp=on", f"cp={cp}"])
    patched = worlds.run(cfg.world_size, _steps_on_rank, cfg, True)
    reference = worlds.run(cfg.world_size, _steps_on_rank, cfg, False)
    assert patched["installed"] and not reference["installed"], "installed with the model"
    assert patched["records"] == reference["records"]
