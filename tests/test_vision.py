"""vision=on: generated image-caption data, 3-D positions exact under CP (with and without MTP),
negative controls that must fail, and images that reach the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe.config import ConfigError
from recipe.data.packing import attach_images, pack_sequences
from recipe.data.shapes import COLOURS, NUM_CAPTIONS, caption, render, shapes_dataset
from recipe.launch.local import launch_world
from recipe.model.mtp import mtp_label_masks, predicted_token_counts, rolled_loss_masks
from recipe.training.trainer import train
from tests.helpers.config import typed_config
from tests.helpers.world import lone_world

RTOL = 1e-5
STEPS = 3
# 16 px images in 4 px patches merged 2x2: a 2 x 2 grid of image tokens per caption. Head
# dimension 16, so the mrope section sums to 8.
VISION = [
    "vision=on",
    "data=shapes",
    "data.shapes.num_train=160",
    "data.shapes.num_eval=16",
    "data.shapes.image_size=16",
    "data.max_seq_len=64",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.num_query_groups=2",
    "vision.mrope_section=[2,3,3]",
    "vision.hidden_size=16",
    "vision.ffn_hidden_size=32",
    "vision.num_layers=1",
    "batching.tokens_per_step=384",
    "batching.max_tokens_per_rank=192",
    "data.max_eval_tokens=512",
    f"trainer.max_steps={STEPS}",
]

_references: dict[str, list[dict]] = {}


def _reference(mtp: str) -> list[dict]:
    if mtp not in _references:
        _references[mtp] = train(typed_config([*VISION, f"mtp={mtp}"]))["history"]
    return _references[mtp]


def _gap(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) / abs(x[key]) for x, y in zip(a, b))


# --- data ---------------------------------------------------------------------------------------


def test_every_attribute_changes_the_image():
    base = ("circle", "red", ("top", "left"), "large")
    image = render(*base, 32, np.random.default_rng(0))
    red = np.all(image == COLOURS["red"], axis=-1)
    assert red[:16, :16].sum() > 20 and red[16:, :].sum() == 0 and red[:, 16:].sum() == 0
    for i, other in enumerate(["square", "blue", ("bottom", "right"), "small"]):
        changed = list(base)
        changed[i] = other
        assert not np.array_equal(render(*changed, 32, np.random.default_rng(0)), image)
    assert caption(*base) == "large red circle, top left."


def test_dataset_stores_images_as_array3d_and_draws_every_caption():
    data = shapes_dataset(2000, 16, seed=3)
    feature = data.features["image"]
    assert type(feature).__name__ == "Array3D" and feature.dtype == "uint8"
    images = data.with_format("numpy")[:]["image"]
    assert images.shape == (2000, 16, 16, 3) and images.min() >= 0 and images.max() <= 255
    assert len(set(data["caption"])) == NUM_CAPTIONS  # 2000 uniform draws cover all 192


def test_sequences_hold_one_placeholder_per_merged_patch_and_no_loss_on_them():
    cfg = typed_config(VISION)
    from recipe.data.corpus import load_corpus

    corpus = load_corpus(cfg.data, cfg.image_grid)
    image_id = corpus.image_token_id
    assert image_id == corpus.tokenizer.vocab_size and corpus.vocab_size == image_id + 1
    first = corpus.train[0]
    assert first[0] == corpus.tokenizer.bos_id and first[1:5] == [image_id] * 4
    assert image_id not in first[5:]
    assert corpus.tokenizer.decode(first[5:]).count(",") == 1
    batch = attach_images(
        pack_sequences(corpus.train[:3], 4, 0), corpus.train[:3], image_id, (2, 2)
    )
    labels_are_images = batch.labels == image_id
    assert labels_are_images.sum() == 12  # BOS and the first three image tokens predict one each
    assert batch.loss_mask[labels_are_images].sum() == 0
    assert batch.loss_mask.sum() == predicted_token_counts(corpus.train[:3], 0, image_id)[0]
    assert batch.images.shape == (3, 3, 16, 16) and batch.image_slot.max() == 11
    # The blind floor: log 192 per caption over the eval captions' predicted tokens.
    predicted = sum(sum(1 for t in s[1:] if t != image_id) for s in corpus.eval)
    assert corpus.baseline_loss == pytest.approx(len(corpus.eval) * math.log(192) / predicted)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=20), min_size=1, max_size=5),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 3),
)
def test_rolled_loss_masks_equal_megatron_style_masks_on_text(sequences, alignment, layers):
    batch = pack_sequences(sequences, alignment, pad_id=9)
    rolled = rolled_loss_masks(batch.loss_mask, batch.cu_seqlens_padded, layers)
    assert torch.equal(
        rolled, mtp_label_masks(batch.position_ids, batch.tokens_per_sequence_length(), layers)
    )
    assert rolled.sum(1).tolist() == predicted_token_counts(sequences, layers)[1]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=20), min_size=1, max_size=5),
    st.integers(1, 3),
)
def test_counts_skip_placeholder_targets_at_every_depth(sequences, layers):
    # Token 5 plays the placeholder: masked as a label, and so at every MTP depth.
    batch = pack_sequences(sequences, 2, pad_id=9)
    batch = batch.replace(loss_mask=batch.loss_mask * (batch.labels != 5))
    rolled = rolled_loss_masks(batch.loss_mask, batch.cu_seqlens_padded, layers)
    main, per_layer = predicted_token_counts(sequences, layers, skip_id=5)
    assert batch.loss_mask.sum() == main and rolled.sum(1).tolist() == per_layer


# --- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["vision=on"], "data=shapes"),
        (["data=shapes"], "vision=on"),
        ([*VISION, "vision.merge=3"], "does not divide"),
        ([*VISION, "vision.patch_size=5"], "not a multiple of vision.patch_size"),
        ([*VISION, "vision.mrope_section=[4,6,6]"], "half the head dimension"),
        ([*VISION, "model.position_embedding_type=learned_absolute"], "rope"),
        ([*VISION, "parallel.tp=2"], "parallel.tp=1"),
        ([*VISION, "vision.positions=local"], "vision.positions"),
    ],
)
def test_bad_vision_settings_are_startup_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        typed_config(overrides)


# --- the model ----------------------------------------------------------------------------------


def test_mrope_with_three_equal_axes_is_rope():
    """Text only, every axis the 1-D position: the mrope model IS the rope model, through
    megatron's THD path and the whole network."""
    from recipe.data.packing import pack_sequences
    from recipe.model.gpt import build_gpt_model
    from recipe.model.mrope import StreamRotaryEmbedding, rope_table, text_positions
    from recipe.training.step import forward_step

    cfg = typed_config(VISION)
    batch = pack_sequences([[1, 2, 3, 4, 5], list(range(7, 40))], alignment=4, pad_id=0)
    with lone_world():
        rope = build_gpt_model(cfg.model, vocab_size=259, max_sequence_length=64, seed=5)
        mrope = build_gpt_model(
            cfg.model, vocab_size=259, max_sequence_length=64, seed=5, mrope_section=[2, 3, 3]
        )
        mrope.rotary_pos_emb = StreamRotaryEmbedding(mrope.rotary_pos_emb)
        ids = text_positions(batch.cu_seqlens_padded).expand(3, -1)
        mrope.rotary_pos_emb.table = rope_table(mrope.rotary_pos_emb, ids, [2, 3, 3])
        expected = forward_step(batch, rope, pass_position_ids=False).per_token_loss
        got = forward_step(batch, mrope, pass_position_ids=False).per_token_loss
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_mrope_refuses_3d_ids_from_outside_and_an_unset_table():
    from recipe.model.gpt import build_gpt_model
    from recipe.model.mrope import StreamRotaryEmbedding

    cfg = typed_config(VISION)
    with lone_world():
        model = build_gpt_model(
            cfg.model, vocab_size=259, max_sequence_length=64, seed=5, mrope_section=[2, 3, 3]
        )
        rope = StreamRotaryEmbedding(model.rotary_pos_emb)
        with pytest.raises(ValueError, match="3-D positions itself"):
            rope(torch.zeros(3, 1, 8, dtype=torch.long), [2, 3, 3])
        with pytest.raises(RuntimeError, match="not set"):
            rope(torch.zeros(1, 8, dtype=torch.long), [2, 3, 3])


# --- parity on spawned gloo ranks ---------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("mtp", ["off", "on"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_with_images_matches_cp1(cp, mtp):
    reference = _reference(mtp)
    history = launch_world(typed_config([*VISION, f"mtp={mtp}", f"cp={cp}"]))["history"]
    assert [h["tokens"] for h in history] == [h["tokens"] for h in reference]
    keys = ["lm_loss", "grad_norm"] + (["mtp_loss"] if mtp == "on" else [])
    for key in keys:
        assert _gap(reference, history, key) < RTOL, key


@pytest.mark.distributed
@pytest.mark.parametrize("positions", ["rank_local", "stock_sharded"])
def test_negative_control_positions_under_cp_fail_parity(positions):
    history = launch_world(typed_config([*VISION, "cp=2", f"vision.positions={positions}"]))
    gap = _gap(_reference("off"), history["history"], "lm_loss")
    assert gap > 100 * RTOL, f"{positions} should break parity, gap was {gap:.2e}"


def test_negative_control_1d_text_positions_fail_against_3d():
    history = train(typed_config([*VISION, "vision.positions=text_1d"]))["history"]
    gap = _gap(_reference("off"), history, "lm_loss")
    assert gap > 100 * RTOL, f"1-D positions in place of 3-D should differ, gap was {gap:.2e}"


def test_images_reach_the_caption_loss():
    """The same run with every caption paired with another sample's image must end clearly
    worse: the model reads the images, not just the caption statistics."""
    longer = [*VISION, "trainer.max_steps=60", "optim.warmup_steps=5", "trainer.eval_every=0"]
    real = train(typed_config(longer))["summary"]
    shuffled = train(typed_config([*longer, "data.shapes.shuffle_images=true"]))["summary"]
    assert shuffled["final_eval_lm_loss"] > real["final_eval_lm_loss"] + 0.02, (real, shuffled)


def test_stock_sharding_rule_is_megatrons(monkeypatch):
    """The stock_sharded control applies megatron's get_pos_emb_on_this_cp_rank rule (chunks r
    and 2cp-1-r of the whole table) with the recipe's index, because megatron's function pins
    memory and moves its index to CUDA. Run megatron's own function with those two calls made
    CPU no-ops and compare."""
    from megatron.core.models.common.embeddings import rope_utils

    from recipe.parallel.cp.zigzag import zigzag_index

    real_tensor = torch.tensor
    monkeypatch.setattr(
        rope_utils.torch, "tensor", lambda *a, pin_memory=False, **k: real_tensor(*a, **k)
    )
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    table = torch.randn(48, 1, 1, 8)
    for cp in (2, 4):
        for rank in range(cp):
            group = type(
                "Group", (), {"size": lambda self, c=cp: c, "rank": lambda self, r=rank: r}
            )()
            stock = rope_utils.get_pos_emb_on_this_cp_rank(table, 0, group)
            ours = table[zigzag_index(torch.tensor([0, 48], dtype=torch.int32), cp, rank)]
            assert torch.equal(stock, ours)


# --- the position_ids policy with a vision model ------------------------------------------------


@pytest.mark.parametrize(
    "mtp, policies", [("off", ["auto", "always"]), ("on", ["mtp_only", "always"])]
)
def test_1d_position_ids_never_reach_mrope(mtp, policies):
    """Passing 1-D text ids (as PR #6267's mtp_only does with MTP, or always) changes nothing
    in a vision model: every policy that runs trains bit-identically to auto."""
    base = train(typed_config([*VISION, f"mtp={mtp}", "trainer.max_steps=2"]))["history"]
    for policy in policies:
        cfg = typed_config(
            [*VISION, f"mtp={mtp}", "trainer.max_steps=2", f"model.pass_position_ids={policy}"]
        )
        history = train(cfg)["history"]
        keys = ["lm_loss", "grad_norm"] + (["mtp_loss"] if mtp == "on" else [])
        assert [[h[k] for k in keys] for h in history] == [[h[k] for k in keys] for h in base]


@pytest.mark.parametrize("policy", ["not_vision", "never"])
def test_vision_with_mtp_refuses_policies_that_pass_no_ids(policy):
    with pytest.raises(ConfigError, match="mtp=on needs position_ids"):
        typed_config([*VISION, "mtp=on", f"model.pass_position_ids={policy}"])


def test_stock_mrope_cannot_take_1d_ids():
    """Why the recipe's rope ignores 1-D ids rather than passing them on: megatron's own module
    reads them as [3, b, s] and fails."""
    from recipe.model.gpt import build_gpt_model

    cfg = typed_config(VISION)
    with lone_world():
        model = build_gpt_model(
            cfg.model, vocab_size=259, max_sequence_length=64, seed=5, mrope_section=[2, 3, 3]
        )
        with pytest.raises((IndexError, RuntimeError)):
            model.rotary_pos_emb(torch.arange(8).unsqueeze(0), [2, 3, 3])
