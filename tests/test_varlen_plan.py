"""The varlen plan (one attention call per layer): every query row is paired with exactly its
causal prefix, checked against the zigzag index on its own, and the plan run entry by entry
computes what the per-sequence path computes, forward and backward, at cp 1/2/4/8, with GQA and
real offsets: bit for bit at cp=1, within 5e-7 in fp32 at cp > 1 (a chunk is its own call); and
whole training steps (MTP, vision) through the plan at cp 1 and 2."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.model.attention import stream_layout, varlen_causal_attention
from recipe.model.varlen_plan import attend_by_plan_reference, varlen_plan
from recipe.parallel.cp.zigzag import zigzag_index


@st.composite
def streams(draw):
    """(padded lengths, real lengths or None, cp, rank): padded lengths multiples of 2*cp, real
    ones anywhere from 0 to the padded length."""
    cp = draw(st.sampled_from([1, 2, 4, 8]))
    rank = draw(st.integers(0, cp - 1))
    units = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    padded = [u * 2 * cp for u in units]
    if draw(st.booleans()):
        return padded, None, cp, rank
    real = [draw(st.integers(0, n)) for n in padded]
    return padded, real, cp, rank


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@settings(max_examples=300, deadline=None)
@given(streams())
def test_each_query_row_attends_to_exactly_its_causal_prefix(stream):
    padded, real, cp, rank = stream
    cu = _cu(padded)
    plan = varlen_plan(cu.tolist(), cp, rank, real)
    # the reference: the global position of every local row, from the zigzag index itself
    position = zigzag_index(cu, cp, rank).tolist() if cp > 1 else list(range(int(cu[-1])))
    starts = cu.tolist()

    def sequence_of(global_position):
        return max(i for i in range(len(padded)) if starts[i] <= global_position)

    rows, keys = plan.query_rows.tolist(), plan.key_rows.tolist()
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    assert len(set(rows)) == len(rows), "a row is asked twice"
    covered = set()
    for e in range(plan.entries):
        entry_rows = rows[cu_q[e] : cu_q[e + 1]]
        entry_keys = keys[cu_k[e] : cu_k[e + 1]]
        shift = len(entry_keys) - len(entry_rows)
        assert shift >= 0
        seq = sequence_of(position[entry_rows[0]])
        for j, row in enumerate(entry_rows):
            own = position[row]
            # bottom-right causal: query j sees keys 0..shift+j, the last of them its own token
            assert entry_keys[: shift + j + 1] == list(range(starts[seq], own + 1))
        covered.update(entry_rows)
    lengths = real or padded
    expected = {
        row
        for row, pos in enumerate(position)
        if pos - starts[sequence_of(pos)] < lengths[sequence_of(pos)]
    }
    assert covered == expected, "every real row once, no padding row"
    assert plan.local_rows == len(position)
    assert plan.max_q == max(cu_q[e + 1] - cu_q[e] for e in range(plan.entries)) if rows else True


def _inputs(padded, real, heads, groups, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(padded)
    key = torch.randn(total, groups, dim, generator=generator, requires_grad=True)
    value = torch.randn(total, groups, dim, generator=generator, requires_grad=True)
    query = torch.randn(total, heads, dim, generator=generator)
    return query, key, value


def _compare(padded, real, cp, heads, groups):
    cu = _cu(padded)
    cu_real = None if real is None else _cu(real)
    full_query, key, value = _inputs(padded, real, heads, groups)
    for rank in range(cp):
        local = zigzag_index(cu, cp, rank) if cp > 1 else torch.arange(int(cu[-1]))
        query = full_query[local].clone().requires_grad_(True)
        reference = varlen_causal_attention(query, key, value, cu, cp, rank, cu_seqlens=cu_real)
        layout = stream_layout(cu, cp, rank, cu_real)
        plan = varlen_plan(layout.bounds, cp, rank, layout.real_lengths)
        got = attend_by_plan_reference(query, key, value, plan).reshape(reference.shape)
        if cp == 1:  # one entry per sequence, the same SDPA call as the per-sequence path
            assert torch.equal(got, reference)
        else:  # each chunk against its own key prefix: 2-4e-7 apart in fp32 (a sequence's two
            # chunks in one masked call there, so the kernel sums over other key blocks)
            torch.testing.assert_close(got, reference, rtol=1e-6, atol=1e-6)
        upstream = torch.randn_like(reference)
        expected = torch.autograd.grad(reference, (query, key, value), upstream)
        grads = torch.autograd.grad(got, (query, key, value), upstream)
        for name, g, e in zip(("query", "key", "value"), grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=f"{name} grad, rank {rank}")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("offsets", ["padded", "real"])
def test_the_plan_computes_what_the_per_sequence_path_computes(cp, heads, groups, offsets):
    padded = [u * 2 * cp for u in (3, 1, 5, 2)]
    real = (
        None if offsets == "padded" else [n - k for n, k in zip(padded, (1, 0, 2 * cp + 1, 2 * cp))]
    )
    _compare(padded, real, cp, heads, groups)


def test_a_sequence_of_padding_only_and_an_empty_stream_output_zeros():
    padded, real = [8, 8], [0, 5]
    _compare(padded, real, 2, 2, 1)
    plan = varlen_plan([0, 8], 2, 1, [0])
    assert plan.entries == 0 and plan.local_rows == 4
    out = attend_by_plan_reference(
        torch.ones(4, 2, 3), torch.ones(8, 1, 3), torch.ones(8, 1, 3), plan
    )
    assert torch.equal(out, torch.zeros(4, 2, 3))


def test_a_length_that_cp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="sequence 1 is 6, not a multiple of 2\\*cp_size=4"):
        varlen_plan([0, 8, 14], 2, 0)


def _flash_varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                           window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    """What torch 2.14's varlen_attn computes, as its docstring and flash attention define it,
    written out in plain math: per entry, softmax(q k^T * scale) v with the causal mask aligned
    to the END of the key range (bottom-right) when window_size == (-1, 0)."""
    heads, groups = query.shape[1], key.shape[1]
    assert heads == groups or enable_gqa, "GQA without enable_gqa: torch raises"
    assert int(cu_seq_q.diff().max()) == max_q and int(cu_seq_k.diff().max()) == max_k
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    scale = scale or query.shape[-1] ** -0.5
    out = []
    for e in range(cu_seq_q.numel() - 1):
        q = query[cu_seq_q[e] : cu_seq_q[e + 1]].transpose(0, 1)
        k = key[cu_seq_k[e] : cu_seq_k[e + 1]].repeat_interleave(heads // groups, 1).transpose(0, 1)
        v = value[cu_seq_k[e] : cu_seq_k[e + 1]].repeat_interleave(heads // groups, 1)
        scores = q @ k.transpose(1, 2) * scale
        if tuple(window_size) == (-1, 0):
            nq, nk = q.shape[1], k.shape[1]
            hidden = torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        out.append((scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1))
    return torch.cat(out)


def _older_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False,
                    scale=None):  # fmt: skip
    """A varlen_attn with `is_causal` and no GQA (the interface before window_size)."""
    assert query.shape[1] == key.shape[1], "no enable_gqa: K/V must come expanded"
    window = (-1, 0) if is_causal else (-1, -1)
    return _flash_varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                  scale=scale, window_size=window)  # fmt: skip


@pytest.mark.parametrize("kernel", [_flash_varlen_stand_in, _older_stand_in], ids=["2.14", "older"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_one_kernel_call_computes_what_the_per_sequence_path_computes(kernel, cp):
    """The call `attend_by_plan` makes (argument order, causal window, GQA, scatter), through a
    stand-in of the kernel written from its definition."""
    from recipe.model.varlen_plan import attend_by_plan

    padded = [u * 2 * cp for u in (3, 1, 5, 2)]
    real = [n - k for n, k in zip(padded, (1, 0, 2 * cp + 1, 2 * cp))]
    cu, cu_real = _cu(padded), _cu(real)
    full_query, key, value = _inputs(padded, real, 4, 2)
    for rank in range(cp):
        local = zigzag_index(cu, cp, rank) if cp > 1 else torch.arange(int(cu[-1]))
        query = full_query[local]
        reference = varlen_causal_attention(query, key, value, cu, cp, rank, cu_seqlens=cu_real)
        layout = stream_layout(cu, cp, rank, cu_real)
        plan = varlen_plan(layout.bounds, cp, rank, layout.real_lengths)
        got = attend_by_plan(query, key, value, plan, kernel=kernel)
        torch.testing.assert_close(got.reshape(reference.shape), reference, rtol=1e-5, atol=1e-6)


def test_the_layer_takes_one_kernel_call_and_computes_the_plan_once(monkeypatch):
    """Where the kernel runs (CUDA, bf16/fp16: played here by forcing the choice), every layer of
    a micro-batch makes one call, with the plan computed by the first; `per_sequence_attention`
    turns it off."""
    import functools

    from megatron.core.packed_seq_params import PackedSeqParams

    from recipe.model import attention
    from recipe.model import varlen_plan as plan_module

    calls = []

    @functools.wraps(_flash_varlen_stand_in)  # its signature: what the call is built from
    def kernel(*args, **kwargs):
        calls.append(args[3])  # cu_seq_q: the plan's tensor, the same object every layer
        return _flash_varlen_stand_in(*args, **kwargs)

    monkeypatch.setattr(plan_module, "varlen_kernel", lambda: kernel)
    monkeypatch.setattr(attention, "uses_varlen_kernel",
                        lambda q: not attention._PER_SEQUENCE_FORCED)  # fmt: skip
    padded, real = [6, 10, 4], [6, 7, 4]
    cu, cu_real = _cu(padded).int(), _cu(real).int()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                             cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu)  # fmt: skip
    query, key, value = _inputs(padded, real, 4, 2)
    layer = object.__new__(attention.PackedCausalAttention)  # the forward reads only these
    layer.softmax_scale, layer.cp_group = None, None
    forward = attention.PackedCausalAttention.forward
    first = forward(layer, query, key, value, packed_seq_params=params)
    second = forward(layer, query, key, value, packed_seq_params=params)
    assert len(calls) == 2 and calls[0] is calls[1], "one call per layer, one plan per batch"
    with attention.per_sequence_attention():
        reference = forward(layer, query, key, value, packed_seq_params=params)
    assert len(calls) == 2, "forced: the per-sequence path"
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-6)
    assert torch.equal(first, second)


def test_the_attention_benchmark_prints_each_path_against_the_limit(capsys):
    """benchmarks/attention.py on a tiny batch (its host-read half is test_host_syncs')."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"
    spec = importlib.util.spec_from_file_location("attention_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--sequences", "3", "--max-len", "24", "--repeats", "1"]
    assert module.main([*argv, "--skip-host-reads"]) == 0
    out = capsys.readouterr().out
    assert "dense causal (limit proxy)" in out and "1.00x the limit" in out
    assert "per-sequence SDPA loop" in out and "plan, entry by entry (CPU stand-in)" in out
    # --check judges the host-read counts (their measurement is test_host_syncs'): growth with
    # depth exits 1 naming both counts, none exits 0
    for counts, code in (((50, 51), 1), ((50, 50), 0)):
        module.host_reads = lambda device, counts=counts: counts
        assert module.main([*argv, "--check"]) == code
        assert ("FAIL: host reads grow with depth (50 at 2 layers, 51 at 4)" in
                capsys.readouterr().out) == (code == 1)  # fmt: skip


def _vision():
    from tests.test_vision import VISION

    return VISION


def _steps_on_rank(cfg, through_plan: bool) -> dict:
    """`cfg.trainer.max_steps` steps on this rank, every attention call made by the per-sequence
    path or (through_plan) as ONE varlen call of the plan with the kernel's stand-in; rank 0's
    records and how many kernel calls it made. Runs in a launched rank or in this process (a
    world of one), and leaves the attention module as it found it."""
    import functools

    from recipe.model import attention
    from recipe.model import varlen_plan as plan_module
    from tests.helpers.training import rank_trainer, train_records

    calls = []

    @functools.wraps(_flash_varlen_stand_in)  # its signature says which interface it has
    def kernel(*args, **kwargs):
        calls.append(1)
        return _flash_varlen_stand_in(*args, **kwargs)

    saved = attention.uses_varlen_kernel, plan_module.varlen_kernel
    attention.uses_varlen_kernel = lambda query: through_plan
    plan_module.varlen_kernel = lambda: kernel
    try:
        with rank_trainer(cfg) as trainer:
            records = train_records(trainer, cfg.trainer.max_steps)
    finally:
        attention.uses_varlen_kernel, plan_module.varlen_kernel = saved
    return {"records": records, "kernel_calls": len(calls)}


@pytest.mark.parametrize("cp", [1, pytest.param(2, marks=pytest.mark.distributed)])
@pytest.mark.parametrize("extra", [["mtp=on"], "vision"], ids=["mtp", "vision"])
def test_training_steps_through_the_plan_match_the_per_sequence_path(extra, cp, worlds):
    """The whole model (every layer, MTP depths, vision's text stream) with each attention call
    made as ONE varlen call, the kernel played by its stand-in: the steps the per-sequence path
    trains, within fp32 rounding (at cp=1 each entry is the same SDPA call: equal; at cp=2 each
    zigzag chunk is its own entry against its sequence's prefix of the gathered K/V)."""
    from tests.helpers.config import typed_config

    extra = _vision() if extra == "vision" else extra
    cfg = typed_config(["trainer.max_steps=3", f"cp={cp}", *extra])
    reference = worlds.run(cfg.world_size, _steps_on_rank, cfg, False)
    assert reference["kernel_calls"] == 0
    planned = worlds.run(cfg.world_size, _steps_on_rank, cfg, True)
    assert planned["kernel_calls"] > 0, "the plan's path ran"
    for mine, theirs in zip(planned["records"], reference["records"], strict=True):
        for key in ("lm_loss", "grad_norm", "mtp_loss"):
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
