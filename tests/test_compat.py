"""The one module that knows megatron-core's version differences, on the stack installed here."""

from __future__ import annotations

import pytest
import torch

from recipe.model import compat


def test_the_installed_megatron_is_a_supported_one():
    assert compat.megatron_version() in compat.SUPPORTED_MEGATRON


def test_local_mtp_token_ratio_is_detected_where_megatron_has_it():
    """0.19 (Megatron-LM PR #3159) scales MTP losses by a local token ratio; 0.16 does not."""
    expected = {"0.16.1": False, "0.19.2": True}[compat.megatron_version()]
    assert compat.mtp_loss_has_local_token_ratio() is expected


def test_mtp_backward_scale_undoes_the_local_ratio(monkeypatch):
    lm, first = torch.tensor(40.0), torch.tensor(30.0)
    monkeypatch.setattr(compat, "mtp_loss_has_local_token_ratio", lambda: False)
    assert float(compat.mtp_backward_scale(120, lm, first)) == pytest.approx(1 / 120)
    monkeypatch.setattr(compat, "mtp_loss_has_local_token_ratio", lambda: True)
    scale = float(compat.mtp_backward_scale(120, lm, first))
    # megatron multiplies by lm / first; the product is the global 1 / 120.
    assert scale * float(lm / first) == pytest.approx(1 / 120)
    # A rank whose micro-batch has no MTP target: megatron clamps the count at 1, so do we.
    empty = compat.mtp_backward_scale(120, lm, torch.tensor(0.0))
    assert float(empty) == pytest.approx(1 / 120 / 40)
    assert float(compat.mtp_backward_scale(0, lm, first)) == 0.0


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
        assert compat.take_mtp_loss_means(2).tolist() == [2.5, 0.5]
        assert compat.take_mtp_loss_means(2).tolist() == [0.0, 0.0], "reset after read"


def test_te_cp_comm_types_are_checked_against_the_te_version():
    from recipe.errors import ConfigError

    compat.check_te_cp_comm_type("p2p", (2, 0))
    compat.check_te_cp_comm_type("a2a", (2, 10))
    compat.check_te_cp_comm_type("all_gather", None)  # no TE: the backend check speaks first
    with pytest.raises(ConfigError, match=r"cp.comm_type=a2a .* >= 2.10, this one is 2.9"):
        compat.check_te_cp_comm_type("a2a", (2, 9))
    with pytest.raises(ConfigError, match=r"cp.comm_type=all_gather .* >= 2.15"):
        compat.check_te_cp_comm_type("all_gather", (2, 14))
