"""Host synchronisations the recipe adds to a training micro-batch must not grow with depth.

On a GPU every read of a device value by the host (`tolist`, `item`, `int(t)`, `bool(t)`) waits
for the kernels queued before it. The torch attention backend needs the sequence boundaries on
the host; it reads them once per micro-batch and keeps them on the micro-batch's
PackedSeqParams, not once per layer. The MTP exact scaling takes the step's global counts from
a tensor copied with the micro-batches, not from a list copied to the device per micro-batch.
A CPU has no synchronisation to count, so these tests count the host reads themselves, with
the counter of gpu_check's host_syncs part on the CPU (`recipe.checks.gpu.counting_host_reads`):
the same calls are the synchronisations on a GPU (its CUDA counter counts those there).
megatron-core's unfused THD RoPE read the boundaries twice per call itself (rope_utils.py, for q
and k in every layer); the model now routes it through recipe/megatron/rope.py, so the reads by
ALL code are gated too: none grows with depth (megatron's MTP code still reads a fixed number per
micro-batch, docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch

from recipe.checks.gpu import counting_host_reads
from tests.helpers.config import typed_config
from tests.helpers.world import lone_world


def _reads_per_micro_batch(num_layers: int, mtp: bool, owner: str = "recipe") -> int:
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
        with counting_host_reads() as counts:
            trainer.forward_backward_step(work)
        return sum(counts.values()) if owner == "all" else counts[owner]


@pytest.mark.stack_dependent
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_host_reads_do_not_grow_with_the_number_of_layers(mtp):
    shallow = _reads_per_micro_batch(1, mtp)
    deep = _reads_per_micro_batch(4, mtp)
    assert deep == shallow, f"{shallow} host reads with 1 layer, {deep} with 4"


@pytest.mark.stack_dependent
@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_host_reads_by_all_code_do_not_grow_with_depth_and_rope_makes_none(mtp, monkeypatch):
    """megatron's unfused THD RoPE read the boundaries for q and k in every layer (4 reads per
    layer); the recipe's vectorised copy (recipe/megatron/rope.py) reads them once per
    micro-batch. Its own control: megatron's function back in place grows with depth."""
    shallow, deep = (_reads_per_micro_batch(n, mtp, "all") for n in (2, 4))
    assert deep == shallow, f"{shallow} host reads by all code with 2 layers, {deep} with 4"
    from recipe.megatron import rope

    module = __import__(rope.ROPE_MODULE, fromlist=["_"])
    monkeypatch.setattr(module, "_apply_rotary_pos_emb_thd", rope.megatron_thd_rope())
    monkeypatch.setattr("recipe.model.gpt.install_thd_rope", lambda: None)
    unpatched = [_reads_per_micro_batch(n, mtp, "megatron") for n in (2, 4)]
    assert unpatched[1] > unpatched[0], unpatched


@pytest.mark.stack_dependent
def test_negative_control_a_per_layer_boundary_read_is_counted(monkeypatch):
    """Without the per-micro-batch layout cache each layer reads the boundaries again: the
    count must notice (else the test above proves nothing)."""
    from recipe.model import attention

    def uncached(packed_seq_params, cp_size, cp_rank):
        padded, real = attention._sequence_bounds(packed_seq_params)
        return attention.stream_layout(padded, cp_size, cp_rank, real)

    shallow = _reads_per_micro_batch(1, False)
    monkeypatch.setattr(attention, "micro_batch_layout", uncached)
    deep = _reads_per_micro_batch(4, False)
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
    p.cu_seqlens_q = p.cu_seqlens_q_padded = other  # both: a real cu_seqlens_q is its own case
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
