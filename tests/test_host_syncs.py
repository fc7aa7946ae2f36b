"""Host synchronisations the recipe adds to a training micro-batch must not grow with depth.

On a GPU every read of a device value by the host (`tolist`, `item`, `int(t)`, `bool(t)`) waits
for the kernels queued before it. The torch attention backend needs the sequence boundaries on
the host; it reads them once per micro-batch and keeps them on the micro-batch's
PackedSeqParams, not once per layer. The MTP exact scaling takes the step's global counts from
a tensor copied with the micro-batches, not from a list copied to the device per micro-batch.
A CPU has no synchronisation to count, so these tests count the host reads themselves: the
same calls are the synchronisations on a GPU (scripts/gpu_check.py counts them there).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import recipe
from tests.helpers.config import typed_config
from tests.helpers.world import lone_world

HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")


@contextlib.contextmanager
def counting_host_reads(monkeypatch):
    """Counts the host reads made by the recipe's own code (the direct caller is a module of
    the `recipe` package). megatron-core's unfused THD RoPE reads the boundaries twice per layer
    itself (rope_utils.py, a per-sequence loop over cu_seqlens, for q and k): that is
    megatron's, documented in docs/gpu.md, and not counted here."""
    counts = {"reads": 0}
    package = str(Path(recipe.__file__).parent)
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(package):
                counts["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        yield counts
    finally:
        monkeypatch.undo()


def _reads_per_micro_batch(monkeypatch, num_layers: int, mtp: bool) -> int:
    """Host reads during the trainer's own forward and backward of one planned micro-batch
    (`Trainer.forward_backward_step`: MTP scaling, forward, loss, backward; the model built and
    the step planned before counting starts)."""
    from recipe.data.corpus import load_corpus
    from recipe.training.step import plan_step
    from recipe.training.trainer import Trainer

    overrides = [f"model.num_layers={num_layers}"] + (["mtp=on"] if mtp else [])
    cfg = typed_config(overrides)
    with lone_world() as layout:
        trainer = Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data))
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (30, 17, 45)]
        work = plan_step(seqs, cfg, layout, pad_id=258, device=torch.device("cpu"))
        work.micro_batches = work.micro_batches[:1]
        with counting_host_reads(monkeypatch) as counts:
            trainer.forward_backward_step(work)
        return counts["reads"]


@pytest.mark.stack_dependent
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_host_reads_do_not_grow_with_the_number_of_layers(monkeypatch, mtp):
    shallow = _reads_per_micro_batch(monkeypatch, 1, mtp)
    deep = _reads_per_micro_batch(monkeypatch, 4, mtp)
    assert deep == shallow, f"{shallow} host reads with 1 layer, {deep} with 4"


@pytest.mark.stack_dependent
def test_negative_control_a_per_layer_boundary_read_is_counted(monkeypatch):
    """Without the per-micro-batch layout cache each layer reads the boundaries again: the
    count must notice (else the test above proves nothing)."""
    from recipe.model import attention

    def uncached(packed_seq_params, cp_size, cp_rank):
        return attention.stream_layout(
            attention._sequence_bounds(packed_seq_params), cp_size, cp_rank
        )

    shallow = _reads_per_micro_batch(monkeypatch, 1, False)
    monkeypatch.setattr(attention, "micro_batch_layout", uncached)
    deep = _reads_per_micro_batch(monkeypatch, 4, False)
    assert deep > shallow


def test_the_layout_cache_follows_the_boundary_tensor():
    """A PackedSeqParams re-pointed at other boundaries (or asked for another CP rank) gets a
    fresh layout, never a stale one."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from recipe.model.attention import micro_batch_layout

    def params(cu):
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu
        )

    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    p = params(cu)
    first = micro_batch_layout(p, 2, 0)
    assert micro_batch_layout(p, 2, 0) is first
    assert micro_batch_layout(p, 2, 1).local_positions.tolist() != first.local_positions.tolist()
    other = torch.tensor([0, 4, 16], dtype=torch.int32)
    p.cu_seqlens_q_padded = other
    assert micro_batch_layout(p, 2, 0).bounds == [0, 4, 16]


def test_mtp_scales_take_the_global_counts_as_a_device_tensor():
    from recipe.model.mtp import mtp_layer_backward_scales

    local_lm = torch.tensor(10)
    local_layers = torch.tensor([9, 8])
    from_list = mtp_layer_backward_scales([40, 0], local_lm, local_layers)
    from_tensor = mtp_layer_backward_scales(
        torch.tensor([40.0, 0.0], dtype=torch.float64), local_lm, local_layers
    )
    assert torch.equal(from_list, from_tensor)
    assert from_list[1] == 0  # a layer with no target anywhere
