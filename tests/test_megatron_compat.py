"""The one module that knows megatron-core's version differences, on the stack installed here."""

from __future__ import annotations

import pytest
import torch

from recipe.model import megatron_compat


def test_the_installed_megatron_is_a_supported_one():
    assert megatron_compat.megatron_version() in megatron_compat.SUPPORTED_MEGATRON


def test_local_mtp_token_ratio_is_detected_where_megatron_has_it():
    """0.19 (Megatron-LM PR #3159) scales MTP losses by a local token ratio; 0.16 does not."""
    expected = {"0.16.1": False, "0.19.2": True}[megatron_compat.megatron_version()]
    assert megatron_compat.mtp_loss_has_local_token_ratio() is expected


def test_mtp_backward_scale_undoes_the_local_ratio(monkeypatch):
    lm, first = torch.tensor(40.0), torch.tensor(30.0)
    monkeypatch.setattr(megatron_compat, "mtp_loss_has_local_token_ratio", lambda: False)
    assert float(megatron_compat.mtp_backward_scale(120, lm, first)) == pytest.approx(1 / 120)
    monkeypatch.setattr(megatron_compat, "mtp_loss_has_local_token_ratio", lambda: True)
    scale = float(megatron_compat.mtp_backward_scale(120, lm, first))
    # megatron multiplies by lm / first; the product is the global 1 / 120.
    assert scale * float(lm / first) == pytest.approx(1 / 120)
    # A rank whose micro-batch has no MTP target: megatron clamps the count at 1, so do we.
    empty = megatron_compat.mtp_backward_scale(120, lm, torch.tensor(0.0))
    assert float(empty) == pytest.approx(1 / 120 / 40)
    assert float(megatron_compat.mtp_backward_scale(0, lm, first)) == 0.0


def test_mtp_loss_means_are_read_and_reset_on_this_stack():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.helpers.world import lone_world

    with lone_world():
        helper = MTPLossLoggingHelper
        if hasattr(helper, "save_metrics_to_tracker"):  # 0.19
            one = torch.tensor(1.0)
            helper.save_metrics_to_tracker(torch.tensor(2.5), one, one, 0, 2)
            helper.save_metrics_to_tracker(torch.tensor(0.5), one, one, 1, 2)
        else:  # 0.16
            helper.save_loss_to_tracker(torch.tensor(2.5), 0, 2)
            helper.save_loss_to_tracker(torch.tensor(0.5), 1, 2)
        assert megatron_compat.take_mtp_loss_means(2).tolist() == [2.5, 0.5]
        assert megatron_compat.take_mtp_loss_means(2).tolist() == [0.0, 0.0], "reset after read"
