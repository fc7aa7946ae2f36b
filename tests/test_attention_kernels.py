"""The torch attention backend calls SDPA with 4-D [1, heads, tokens, dim] tensors (CUDA's flash
and memory-efficient kernels refuse 3-D input and fall back to the math kernel without a word).
On the CPU the 4-D call takes the CPU flash kernel on every torch here. Where the 3-D call took it
too (torch 2.14) not a bit changes; on torch 2.11 (the GPU image's) and 2.13 the 3-D call took the
math kernel, so there the change moves results by fp32 / bf16 rounding only. The kernel SDPA
takes is recorded, only while a recording context is open, as torch itself selects it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from recipe.data.thd import cu_seqlens_from_lengths
from recipe.model import attention
from recipe.model.attention import (
    recording_attention_kernels,
    sdpa_kernel_choice,
    stream_layout,
    varlen_causal_attention,
)

LENGTHS = [48, 16, 80]  # padded for cp=2: multiples of 4
HEADS, GROUPS, DIM = 4, 2, 16
# The CPU operator that runs each kernel SDPA can pick on the CPU.
CPU_KERNEL_OPERATORS = {
    "flash_attention": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "math": "aten::_scaled_dot_product_attention_math",
}


def attention_3d(query, key, value, cu, cp_size=1, cp_rank=0):
    """The torch backend's attention as it was before: SDPA on 3-D [heads, tokens, dim]."""
    heads, groups = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // groups, dim=1)
    value = value.repeat_interleave(heads // groups, dim=1)
    layout = stream_layout(cu, cp_size, cp_rank)
    outputs = []
    for start, end in zip(layout.bounds[:-1], layout.bounds[1:]):
        q_start, q_end = start // cp_size, end // cp_size
        q = query[q_start:q_end].transpose(0, 1)
        k = key[start:end].transpose(0, 1)
        v = value[start:end].transpose(0, 1)
        if cp_size == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q_pos = layout.local_positions[q_start:q_end] - start
            mask = torch.arange(end - start).unsqueeze(0) <= q_pos.unsqueeze(1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        outputs.append(out.transpose(0, 1))
    out = torch.cat(outputs)
    return out.reshape(out.shape[0], -1)


def stream(dtype, cp_size=1, cp_rank=0):
    """q (this rank's tokens, zigzag order under CP), the full k and v, the boundaries."""
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(total, GROUPS, DIM, generator=gen).to(dtype)
    v = torch.randn(total, GROUPS, DIM, generator=gen).to(dtype)
    cu = cu_seqlens_from_lengths(torch.tensor(LENGTHS))
    if cp_size > 1:
        q = q[stream_layout(cu, cp_size, cp_rank).local_positions]
    return [t.detach().requires_grad_() for t in (q, k, v)], cu


def outputs_and_gradients(function, dtype, cp_size, cp_rank):
    (q, k, v), cu = stream(dtype, cp_size, cp_rank)
    out = function(q, k, v, cu, cp_size, cp_rank)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    return [out, *grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "cp_size, cp_rank", [(1, 0), (2, 0), (2, 1)], ids=["cp1", "cp2_rank0", "cp2_rank1"]
)
def test_4d_sdpa_gives_the_3d_bits_on_the_cpu(dtype, cp_size, cp_rank):
    """Outputs and the gradients of q, k, v, causal (cp=1) and masked (cp=2): identical where
    this torch sends both shapes to the same kernel (2.14), within rounding of the largest value
    where the 3-D call took the math kernel (2.11, 2.13)."""
    four_d = outputs_and_gradients(varlen_causal_attention, dtype, cp_size, cp_rank)
    three_d = outputs_and_gradients(attention_3d, dtype, cp_size, cp_rank)
    same_kernel = len(set(kernels_by_shape(dtype, masked=cp_size > 1).values())) == 1
    for new, old in zip(four_d, three_d):
        assert new.dtype == old.dtype == dtype
        relative = float((new.float() - old.float()).abs().max() / old.float().abs().max())
        if same_kernel:
            assert torch.equal(new, old), relative
        else:
            # measured on 2.11 and 2.13: 5.7e-7 (fp32), 6.2e-3 (bf16, under one bf16 step)
            assert relative <= (2e-6 if dtype == torch.float32 else 2e-2), relative


def test_negative_control_another_kernel_is_not_the_same_bits():
    """The comparison above sees a kernel change: the 3-D call on the math kernel differs."""
    four_d = outputs_and_gradients(varlen_causal_attention, torch.float32, 1, 0)
    with sdpa_kernel([SDPBackend.MATH]):
        three_d_on_math = outputs_and_gradients(attention_3d, torch.float32, 1, 0)
    assert not any(torch.equal(new, old) for new, old in zip(four_d, three_d_on_math))


def operators_run(call) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return {e.name for e in prof.events() if e.name in CPU_KERNEL_OPERATORS.values()}


def kernels_by_shape(dtype, masked: bool) -> dict[str, str]:
    """The kernel this torch's SDPA takes on the CPU for a 3-D and a 4-D call, checked against
    the operator the profiler sees run."""
    q = torch.randn(HEADS, 32, DIM).to(dtype)
    mask = torch.ones(32, 32, dtype=torch.bool).tril() if masked else None
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    seen = {}
    for shape, x in (("3-D", q), ("4-D", q.unsqueeze(0))):
        choice = sdpa_kernel_choice(x, x, x, mask, not masked)
        ran = operators_run(lambda x=x: F.scaled_dot_product_attention(x, x, x, **kwargs))
        assert ran == {CPU_KERNEL_OPERATORS[choice]}, (shape, choice, ran)
        seen[shape] = choice
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked"])
def test_the_cpu_takes_flash_for_4d_and_the_record_says_which_kernel_ran(dtype, masked):
    """The 4-D call goes to the CPU flash kernel on every torch here (the 3-D one too on 2.14,
    to the math kernel on 2.11 and 2.13); the recorded choice is what the profiler sees run. With
    only the math kernel allowed, the record says math (the record follows torch's selection,
    it does not assume a kernel)."""
    seen = kernels_by_shape(dtype, masked)
    assert seen["4-D"] == "flash_attention", seen
    assert seen["3-D"] in ("flash_attention", "math"), seen
    q = torch.randn(HEADS, 32, DIM).to(dtype)
    mask = torch.ones(32, 32, dtype=torch.bool).tril() if masked else None
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    with sdpa_kernel([SDPBackend.MATH]):
        x = q.unsqueeze(0)
        assert sdpa_kernel_choice(x, x, x, mask, not masked) == "math"
        ran = operators_run(lambda: F.scaled_dot_product_attention(x, x, x, **kwargs))
        assert ran == {CPU_KERNEL_OPERATORS["math"]}


def test_kernels_are_recorded_only_inside_a_recording_context(monkeypatch):
    """Training (no context open) never asks for the choice; an open context collects
    (dtype, kernel) of every call, the dtype autocast's where autocast is on; nested contexts
    each get every call made inside them."""
    asked = []
    real = attention.sdpa_kernel_choice

    def counted(*args, **kwargs):
        asked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_kernel_choice", counted)
    (q, k, v), cu = stream(torch.float32)
    varlen_causal_attention(q, k, v, cu)
    assert asked == []
    with recording_attention_kernels() as outer:
        varlen_causal_attention(q, k, v, cu)
        with recording_attention_kernels() as inner, torch.autocast("cpu", dtype=torch.bfloat16):
            varlen_causal_attention(q, k, v, cu)
    assert len(asked) == 2 * len(LENGTHS)
    assert inner == {("bfloat16", "flash_attention")}
    assert outer == {("float32", "flash_attention"), ("bfloat16", "flash_attention")}
    varlen_causal_attention(q, k, v, cu)
    assert len(asked) == 2 * len(LENGTHS), "a closed context still asks"


def test_a_torch_without_the_selection_function_records_unknown(monkeypatch):
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    x = torch.randn(1, HEADS, 8, DIM)
    assert sdpa_kernel_choice(x, x, x, None, True) == attention.UNKNOWN_KERNEL
