"""The real megatron-core GPT on packed THD batches: packing must not change any token's loss."""

from __future__ import annotations

import pytest
import torch

from recipe.data.packing import pack_sequences
from recipe.model.gpt import build_gpt_model
from tests.helpers.config import typed_config
from tests.helpers.micro import run_packed
from tests.helpers.world import lone_world

pytestmark = pytest.mark.stack_dependent


@pytest.fixture(scope="module")
def world():
    with lone_world() as layout:
        yield layout


class _Model:
    """The GPT of a config, run on a micro-batch the way training runs one."""

    def __init__(self, position_embedding_type: str, num_query_groups: int = 2):
        self.cfg = typed_config(
            [
                f"model.position_embedding_type={position_embedding_type}",
                f"model.num_query_groups={num_query_groups}",
                "model.num_layers=2",
                "model.pass_position_ids=always",  # the negative control shifts them
            ]
        )
        self.gpt = build_gpt_model(self.cfg.model, vocab_size=259, max_sequence_length=256, seed=0)

    def run(self, batch, layout, backward: bool = False):
        return run_packed(batch, self.gpt, self.cfg, layout, backward=backward)


def _per_token_loss(model: _Model, batch, layout):
    return model.run(batch, layout).per_token_loss


@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
@pytest.mark.parametrize("alignment", [1, 8])
def test_packed_loss_equals_one_sequence_at_a_time(world, pe, alignment):
    model = _Model(pe)
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 5, 120, 2, 64]
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    packed = pack_sequences(seqs, alignment, pad_id=258)
    with torch.no_grad():
        together = _per_token_loss(model, packed, world)
        for i, seq in enumerate(seqs):
            alone = _per_token_loss(model, pack_sequences([seq], 1, pad_id=258), world)
            start = int(packed.cu_seqlens_padded[i])
            torch.testing.assert_close(
                together[start : start + len(seq) - 1], alone[: len(seq) - 1], rtol=1e-5, atol=1e-5
            )


def test_packing_really_separates_sequences(world):
    """Guard for the test above: if attention leaked across sequences, losses would move."""
    model = _Model("rope")
    seqs = [[7] * 30, list(range(40))]
    with torch.no_grad():
        packed = _per_token_loss(model, pack_sequences(seqs, 1, 258), world)
        swapped = _per_token_loss(model, pack_sequences([[9] * 30, list(range(40))], 1, 258), world)
        leaky = torch.testing.assert_close
        # The second sequence's losses must not depend on the first sequence's tokens.
        leaky(packed[30:69], swapped[30:69], rtol=1e-6, atol=1e-6)
        # ... while its first positions do depend on its own tokens (sanity: the model is not
        # constant).
        assert not torch.allclose(packed[:29], swapped[:29])


def test_grouped_query_attention_and_backward(world):
    model = _Model("rope", num_query_groups=1)
    batch = pack_sequences([[1, 2, 3, 4, 5], [6, 7, 8]], 1, 258)
    model.run(batch, world, backward=True)
    grads = [p.grad for p in model.gpt.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_learned_absolute_positions_are_used(world):
    """With learned positions, shifted position_ids change the loss (the CP tests rely on it)."""
    model = _Model("learned_absolute")
    batch = pack_sequences([list(range(50))], 1, 258)
    shifted = batch.replace(position_ids=batch.position_ids + 1)
    with torch.no_grad():
        assert not torch.allclose(
            _per_token_loss(model, batch, world), _per_token_loss(model, shifted, world)
        )
