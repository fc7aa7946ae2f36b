"""The one module that knows megatron-core's version differences (and the MTP scaling that depends
on one of them), on the stack installed here."""

from __future__ import annotations

import pytest
import torch

from recipe.megatron import versions as compat
from recipe.model import mtp

pytestmark = pytest.mark.stack_dependent


def test_the_installed_megatron_is_a_supported_one():
    assert compat.megatron_version() in compat.SUPPORTED_MEGATRON


def test_local_mtp_token_ratio_is_detected_where_megatron_has_it():
    """0.19 (Megatron-LM PR #3159) scales MTP losses by a local token ratio; 0.16 does not."""
    expected = {"0.16.1": False, "0.19.2": True}[compat.megatron_version()]
    assert compat.mtp_loss_has_local_token_ratio() is expected


def test_mtp_layer_scales_are_global_per_layer_and_undo_the_local_ratio(monkeypatch):
    lm, layers = torch.tensor(40.0), torch.tensor([30.0, 0.0, 25.0])
    global_counts = [120, 0, 90]
    monkeypatch.setattr(mtp, "mtp_loss_has_local_token_ratio", lambda: False)
    plain = mtp.mtp_layer_backward_scales(global_counts, lm, layers).tolist()
    assert plain == pytest.approx([1 / 120, 0.0, 1 / 90])
    monkeypatch.setattr(mtp, "mtp_loss_has_local_token_ratio", lambda: True)
    undone = mtp.mtp_layer_backward_scales(global_counts, lm, layers)
    # megatron multiplies layer k by lm / clamp(count_k, 1); the product is the global 1 / N_k.
    megatron_ratio = lm / layers.clamp(min=1)
    assert (undone * megatron_ratio).tolist() == pytest.approx([1 / 120, 0.0, 1 / 90])


def test_exact_scaling_refuses_a_megatron_that_never_takes_the_scales():
    """If megatron stopped calling the autoscaler the recipe replaces, the queued per-layer
    scales stay unused: that must stop the run, not fall back silently to megatron's weighting."""
    local_layers = torch.tensor([45.0, 40.0])
    scales = mtp.MTPBackwardScales()
    scales.prepare("exact", 100, [90, 80], torch.tensor(50.0), local_layers)
    with pytest.raises(RuntimeError, match="not taken by megatron"):
        scales.confirm_taken()
    scales.confirm_taken()  # the queue was cleared: the next step starts clean


def test_two_scales_objects_take_turns_at_megatrons_autoscaler():
    """Two Trainers in one process (benchmarks/engine_step.py steps both engines in turn): each
    micro-batch's `prepare` binds its own object's autoscaler, so the MTP layers of the forward
    that follows take the scales just queued, whichever object was made or bound last."""
    from megatron.core.transformer import multi_token_prediction

    first, second = mtp.MTPBackwardScales(), mtp.MTPBackwardScales()
    counts = (100, [90, 80], torch.tensor(50.0), torch.tensor([45.0, 40.0]))
    for scales in (first, second, first, second):
        scales.prepare("exact", *counts)
        bound = multi_token_prediction.MTPLossAutoScaler
        assert bound is scales.autoscaler
        for _ in range(2):  # one call per MTP layer, as megatron makes them
            bound.apply(torch.ones(2, requires_grad=True), torch.tensor(1.0, requires_grad=True))
        scales.confirm_taken()


def test_mtp_loss_means_are_read_and_reset_on_this_stack():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.helpers.world import lone_world

    def save(losses: list[float]) -> None:
        helper = MTPLossLoggingHelper
        for layer, loss in enumerate(losses):
            if hasattr(helper, "save_metrics_to_tracker"):  # 0.19
                one = torch.tensor(1.0)
                helper.save_metrics_to_tracker(torch.tensor(loss), one, one, layer, len(losses))
            else:  # 0.16
                helper.save_loss_to_tracker(torch.tensor(loss), layer, len(losses))

    with lone_world():
        save([2.5, 0.5])
        assert mtp.take_mtp_loss_means(2).tolist() == [2.5, 0.5]
        assert mtp.take_mtp_loss_means(2).tolist() == [0.0, 0.0], "reset after read"
        # A later model with more MTP layers in the same process (a one-process sweep).
        save([1.0, 2.0, 3.0])
        assert mtp.take_mtp_loss_means(3).tolist() == [1.0, 2.0, 3.0]


def test_te_cp_comm_types_are_checked_against_the_te_version():
    from recipe.errors import ConfigError

    compat.check_te_cp_comm_type("p2p", (2, 0))
    compat.check_te_cp_comm_type("a2a", (2, 10))
    compat.check_te_cp_comm_type("all_gather", None)  # no TE: the backend check speaks first
    with pytest.raises(ConfigError, match=r"cp.comm_type=a2a .* >= 2.10, this one is 2.9"):
        compat.check_te_cp_comm_type("a2a", (2, 9))
    with pytest.raises(ConfigError, match=r"cp.comm_type=all_gather .* >= 2.15"):
        compat.check_te_cp_comm_type("all_gather", (2, 14))
