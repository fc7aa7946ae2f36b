"""Real offsets in cu_seqlens_q, padded ones in cu_seqlens_q_padded (Megatron-Bridge's packed SFT).

The stream stays laid out by the padded offsets; the `torch` attention backend then hides every
key past a sequence's real length and gives padded query rows an output of exactly zero, as
Transformer Engine's THD attention does with both fields. The unit tests check the attention
against the padded-offsets path and against plain softmax attention over the real tokens alone;
the model tests check that every real token's LM loss is the cp=1 loss (RoPE under CP slices by
the padded field), and record what megatron-core's MTP roll does with real offsets: it reads only
cu_seqlens_q, so its rolled labels leave the ground truth, or it raises.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.data.packing import PackedBatch, pack_sequences
from recipe.data.thd import cu_seqlens_from_lengths
from recipe.model.attention import micro_batch_layout, varlen_causal_attention
from recipe.model.gpt import packed_seq_params
from recipe.parallel.cp.zigzag import zigzag_index

VOCAB = 259
PAD_ID = 258
# 2*cp of the largest cp here: the cp=1 and cp=2 runs share one global stream, slot for slot.
ALIGNMENT = 4
LENGTHS = [5, 9, 3]
"""Every sequence needs padding at alignment 4. With real offsets at cp=2 megatron's MTP roll
gets a one-slot local slice of the last sequence (17 // 2 - 14 // 2 = 1) and raises."""
ROLLABLE = [6, 9, 4]
"""Real local slices of 3, 4 and 2 slots at cp=2: megatron's MTP roll runs with real offsets."""


# --- the attention itself ------------------------------------------------------------------


def _stream(real: list[int], padded: list[int], heads=4, groups=2, dim=8, seed=0):
    """Random q, k, v over the padded stream and both offset tensors."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(padded)
    query = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    key = torch.randn(total, groups, dim, generator=gen, dtype=torch.float64)
    value = torch.randn(total, groups, dim, generator=gen, dtype=torch.float64)
    cu_real = cu_seqlens_from_lengths(torch.tensor(real))
    cu_padded = cu_seqlens_from_lengths(torch.tensor(padded))
    return query, key, value, cu_real, cu_padded


def _real_rows(real: list[int], padded: list[int]) -> torch.Tensor:
    """[T] bool over the padded stream: the slots that hold a real token."""
    return torch.cat([torch.arange(p) < n for n, p in zip(real, padded)])


def _reference(query, key, value, real, padded) -> torch.Tensor:
    """Plain softmax attention of each sequence's real tokens over its real tokens alone, causal;
    zero on padded rows. [T, heads * dim] in global order."""
    heads, groups, dim = query.shape[1], key.shape[1], query.shape[2]
    out = torch.zeros(query.shape[0], heads, dim, dtype=query.dtype)
    start = 0
    for n, p in zip(real, padded):
        rows = slice(start, start + n)
        for h in range(heads):
            g = h // (heads // groups)
            scores = query[rows, h] @ key[rows, g].T / dim**0.5
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[rows, h] = scores.softmax(-1) @ value[rows, g]
        start += p
    return out.reshape(out.shape[0], -1)


def _on_rank(query, key, value, cu_padded, cp, rank, cu_real=None):
    """Rank `rank`'s output: its zigzag share of the queries against the whole K/V stream (what
    PackedCausalAttention hands the function after its all-gather), in local order."""
    index = zigzag_index(cu_padded, cp, rank)
    return varlen_causal_attention(
        query[index], key, value, cu_padded, cp, rank, cu_seqlens=cu_real
    ), index


@pytest.mark.parametrize("cp", [1, 2])
def test_real_offsets_keep_real_rows_and_zero_padded_rows(cp):
    # ... and a trailing padding-only segment, as Bridge's collate appends one
    real = [*LENGTHS, 0]
    padded = [-(-n // (2 * cp)) * 2 * cp for n in LENGTHS] + [2 * cp]
    query, key, value, cu_real, cu_padded = _stream(real, padded)
    query.requires_grad_(True)
    is_real = _real_rows(real, padded)
    for rank in range(cp):
        with_real, index = _on_rank(query, key, value, cu_padded, cp, rank, cu_real)
        padded_only, _ = _on_rank(query, key, value, cu_padded, cp, rank)
        mine = is_real[index]
        # the causal mask already hides each sequence's padding from its real rows
        torch.testing.assert_close(with_real[mine], padded_only[mine], rtol=1e-12, atol=1e-12)
        assert bool((with_real[~mine] == 0).all())
        # negative control: the padded-offsets path lets padded rows attend (nonzero output)
        assert bool((padded_only[~mine] != 0).any(dim=-1).all())
        # a fully masked row would be NaN in SDPA, and so would its gradient
        (grad,) = torch.autograd.grad(with_real.sum(), query)
        assert bool(torch.isfinite(grad).all())
        assert bool((grad[~is_real] == 0).all())


@st.composite
def _packings(draw):
    """(real lengths, padded lengths, cp): aligned to a multiple of 2*cp, sometimes with a
    whole extra alignment unit, and sometimes a trailing pad segment of real length 0 (what
    Bridge's collate appends when the bin's padding needs a pseudo-sequence)."""
    cp = draw(st.sampled_from([1, 2, 3]))
    unit = 2 * cp * draw(st.sampled_from([1, 2]))
    real = draw(st.lists(st.integers(1, 13), min_size=1, max_size=4))
    padded = [-(-n // unit) * unit + unit * draw(st.integers(0, 1)) for n in real]
    if draw(st.booleans()):
        real.append(0)
        padded.append(unit)
    return real, padded, cp


@settings(max_examples=40, deadline=None)
@given(_packings(), st.integers(0, 2**16))
def test_real_offsets_attention_is_softmax_over_the_real_tokens(packing, seed):
    real, padded, cp = packing
    query, key, value, cu_real, cu_padded = _stream(real, padded, seed=seed)
    expected = _reference(query, key, value, real, padded)
    for rank in range(cp):
        got, index = _on_rank(query, key, value, cu_padded, cp, rank, cu_real)
        torch.testing.assert_close(got, expected[index], rtol=1e-10, atol=1e-10)


def test_negative_control_padded_offsets_are_not_the_real_softmax():
    """The reference above can fail: the padded-offsets path differs from it on padded rows."""
    real, padded = LENGTHS, [8, 12, 4]
    query, key, value, _, cu_padded = _stream(real, padded)
    got, _ = _on_rank(query, key, value, cu_padded, 2, 0)
    index = zigzag_index(cu_padded, 2, 0)
    assert not torch.allclose(got, _reference(query, key, value, real, padded)[index])


def test_packed_seq_params_fills_each_convention():
    batch = pack_sequences([[1] * n for n in LENGTHS], ALIGNMENT, PAD_ID)
    padded = packed_seq_params(batch)
    assert padded.cu_seqlens_q is batch.cu_seqlens_padded
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(padded, name) is batch.cu_seqlens_padded
    real = packed_seq_params(batch, "real")
    assert real.cu_seqlens_q is batch.cu_seqlens and real.cu_seqlens_kv is batch.cu_seqlens
    assert real.cu_seqlens_q_padded is batch.cu_seqlens_padded
    assert real.cu_seqlens_kv_padded is batch.cu_seqlens_padded
    assert real.max_seqlen_q == real.max_seqlen_kv == padded.max_seqlen_q == batch.max_seqlen
    with pytest.raises(ValueError, match="padded.*real"):
        packed_seq_params(batch, "unpadded")


def test_layout_cache_follows_both_fields():
    batch = pack_sequences([[1] * n for n in LENGTHS], ALIGNMENT, PAD_ID)
    params = packed_seq_params(batch, "real")
    layout = micro_batch_layout(params, 1, 0)
    assert layout.real_lengths == LENGTHS
    assert micro_batch_layout(params, 1, 0) is layout  # once per micro-batch
    params.cu_seqlens_q = batch.cu_seqlens_padded.clone()  # equal values, another tensor
    equal = micro_batch_layout(params, 1, 0)
    assert equal is not layout and equal.real_lengths is None  # the padded path, unchanged
    params.cu_seqlens_q = batch.cu_seqlens
    assert micro_batch_layout(params, 1, 0).real_lengths == LENGTHS
    assert micro_batch_layout(packed_seq_params(batch), 1, 0).real_lengths is None


@pytest.mark.parametrize(
    "real, fragment",
    [
        ([0, 5, 14, 19], "padded length"),
        ([0, 5, 14], "sequences"),
        ([0, 9, 4, 17], "padded length"),
    ],
)
def test_real_offsets_that_do_not_fit_the_padded_ones_are_refused(real, fragment):
    batch = pack_sequences([[1] * n for n in LENGTHS], ALIGNMENT, PAD_ID)
    params = packed_seq_params(batch, "real")
    params.cu_seqlens_q = torch.tensor(real, dtype=torch.int32)
    with pytest.raises(ValueError, match=fragment):
        micro_batch_layout(params, 1, 0)


# --- the model -----------------------------------------------------------------------------


def _config(cp: int, pe: str, mtp: bool):
    from tests.helpers.config import typed_config

    overrides = [f"cp={cp}", f"model.position_embedding_type={pe}"]
    return typed_config(overrides + (["mtp=on"] if mtp else []))


def _sequences(lengths: list[int]) -> list[list[int]]:
    """Token ids unique per slot, so a label taken from the wrong slot cannot match."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


@contextlib.contextmanager
def _recorded_rolls():
    """Every call of megatron's MTP `roll_tensor` in the block: (input, rolled) pairs. 0.19 calls
    it from its MTP module only, 0.16 from gpt_model too (its own import of the name)."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    original = multi_token_prediction.roll_tensor
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(tensor, *args, **kwargs):
        before = tensor.detach().clone()
        rolled, total = original(tensor, *args, **kwargs)
        calls.append((before, rolled.detach().clone()))
        return rolled, total

    modules = [
        module
        for module in (multi_token_prediction, gpt_model)
        if getattr(module, "roll_tensor", None) is original
    ]
    for module in modules:
        module.roll_tensor = recording
    try:
        yield calls
    finally:
        for module in modules:
            module.roll_tensor = original


def _rolled(calls, local: torch.Tensor) -> torch.Tensor:
    """What megatron made of `local` in its first roll of it (MTP layer 1's)."""
    for before, rolled in calls:
        if before.dtype == local.dtype and torch.equal(before.squeeze(0), local):
            return rolled.squeeze(0)
    raise AssertionError("megatron's MTP block never rolled this tensor")


def _to_global(local: torch.Tensor, cu_padded: torch.Tensor, cp: int) -> torch.Tensor:
    import torch.distributed as dist

    from recipe.parallel import groups
    from recipe.parallel.cp.zigzag import unshard

    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=groups.cp_group())
    return unshard(parts, cu_padded, cp)


def _run(model, cfg, layout, lengths: list[int], convention: str) -> dict:
    """One hand-packed micro-batch through the model, called as training calls it, with the
    given cu_seqlens_q convention: every per-token result in global slot order."""
    from recipe.model.mtp import take_mtp_loss_means
    from recipe.parallel.cp.shard import shard_batch

    cp = layout.cp_size
    batch = pack_sequences(_sequences(lengths), ALIGNMENT, PAD_ID)
    local = shard_batch(batch, cp, layout.cp_rank)
    mtp = cfg.mtp.enabled
    with torch.no_grad(), _recorded_rolls() as calls:
        loss = model(
            input_ids=local.input_ids.unsqueeze(0),
            position_ids=local.position_ids.unsqueeze(0) if cfg.passes_position_ids else None,
            attention_mask=None,
            labels=local.labels.unsqueeze(0),
            packed_seq_params=packed_seq_params(local, convention),
            **({"loss_mask": local.loss_mask.unsqueeze(0)} if mtp else {}),
        )
    if mtp:
        take_mtp_loss_means(cfg.mtp.num_layers)  # leave megatron's tracker empty
    out = {"lm": loss.squeeze(0)}
    if mtp:
        out["labels"] = _rolled(calls, local.labels)
        out["loss_mask"] = _rolled(calls, local.loss_mask)
    cu = batch.cu_seqlens_padded
    return {"batch": batch, **{k: _to_global(v, cu, cp) for k, v in out.items()}}


def _runs_on_rank(cp: int, runs: list[tuple[str, bool, list[int], str]]) -> list[dict]:
    """Every (position embedding, mtp, lengths, convention) run in megatron's parallel state for
    cp on this rank, one model per (pe, mtp) built from the same seed."""
    from recipe.megatron.cpu_patches import install_cpu_patches, seed_model_parallel_rng
    from recipe.model.gpt import build_gpt_model
    from recipe.parallel import groups

    install_cpu_patches()
    results = []
    with groups.parallel_world(_config(cp, "rope", False).parallel_dims) as layout:
        seed_model_parallel_rng(0)
        models = {}
        for pe, mtp, lengths, convention in runs:
            cfg = _config(cp, pe, mtp)
            if (pe, mtp) not in models:
                models[pe, mtp] = build_gpt_model(
                    cfg.model, mtp_cfg=cfg.mtp, vocab_size=VOCAB, max_sequence_length=64,
                    seed=0, cp_size=cp,
                )  # fmt: skip
            results.append(_run(models[pe, mtp], cfg, layout, lengths, convention))
    return results


RUNS = [
    (pe, mtp, lengths, convention)
    for pe in ("rope", "learned_absolute")
    for mtp, lengths in ((False, LENGTHS), (True, ROLLABLE))
    for convention in ("padded", "real")
]


@pytest.fixture(scope="module")
def runs(worlds):
    """{(cp, pe, mtp, lengths, convention): global results} of every run at cp=1 (in this
    process) and cp=2 (on the session's world of 2), one job per cp."""
    results = {}
    for cp in (1, 2):
        for run, result in zip(RUNS, worlds.run(cp, _runs_on_rank, cp, RUNS)):
            pe, mtp, lengths, convention = run
            results[cp, pe, mtp, tuple(lengths), convention] = result
    return results


def _is_real(batch: PackedBatch) -> torch.Tensor:
    return batch.position_ids < batch.tokens_per_sequence_length()


@pytest.mark.stack_dependent
@pytest.mark.distributed
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("mtp", [False, True], ids=["mtp-off", "mtp-on"])
@pytest.mark.parametrize("cp", [1, 2])
def test_real_offsets_give_every_real_token_the_cp1_loss(runs, cp, pe, mtp):
    lengths = tuple(ROLLABLE if mtp else LENGTHS)
    reference = runs[1, pe, mtp, lengths, "padded"]
    got = runs[cp, pe, mtp, lengths, "real"]
    real = _is_real(reference["batch"])
    assert int(real.sum()) == sum(lengths)
    torch.testing.assert_close(got["lm"][real], reference["lm"][real], rtol=1e-5, atol=0)
    # negative control: the real-offsets path is taken (padded rows' outputs are zeroed in every
    # layer, so what the padded slots compute changes), not the padded path run twice
    assert not torch.allclose(got["lm"][~real], reference["lm"][~real], rtol=1e-3, atol=0)


def _roll_wrong_slots(result: dict) -> torch.Tensor:
    """Slots where megatron's rolled MTP loss mask differs from the ground truth (the loss mask
    rolled within each padded sequence), or its rolled label does where the truth counts it."""
    from recipe.checks.mtp_roll import rolled_truth

    batch = result["batch"]
    cu = batch.cu_seqlens_padded
    mask, labels = rolled_truth(batch.loss_mask, cu), rolled_truth(batch.labels, cu)
    return (result["loss_mask"] != mask) | ((mask == 1) & (result["labels"] != labels))


@pytest.mark.stack_dependent
@pytest.mark.distributed
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("cp", [1, 2])
def test_megatron_mtp_roll_matches_the_truth_with_padded_offsets(runs, cp, pe):
    result = runs[cp, pe, True, tuple(ROLLABLE), "padded"]
    # MTP layer 1 predicts token t+2 of the same sequence: n - 2 targets per sequence
    assert int(result["loss_mask"].sum()) == sum(n - 2 for n in ROLLABLE) > 0
    assert not bool(_roll_wrong_slots(result).any())


@pytest.mark.stack_dependent
@pytest.mark.distributed
@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("cp", [1, 2])
def test_megatron_mtp_roll_leaves_the_truth_with_real_offsets(runs, cp, pe):
    """The negative control of the test above and the conventions table's finding: megatron-core's
    packed roll (multi_token_prediction.py `_roll_tensor_packed_seq`) reads only cu_seqlens_q
    and indexes the padded stream with it (divided by cp under CP), so real offsets roll labels
    across the wrong windows: MTP targets are lost or taken from another sequence."""
    wrong = _roll_wrong_slots(runs[cp, pe, True, tuple(ROLLABLE), "real"])
    assert bool(wrong.any())


# With lengths whose last sequence gets a one-slot local slice at cp=2 (e.g. [5, 9, 3]) megatron's
# roll raises IndexError instead: tests/test_upstream_roll.py checks that on the released roll
# (in a world that goes on), and the conventions table shows it in training (RAISES).
