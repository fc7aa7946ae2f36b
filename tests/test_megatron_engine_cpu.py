"""megatron's own engine on a CPU: every patch of recipe/megatron/cpu_patches.py is still
needed (and at the lines recorded for this release). That the patched engine then trains the
recipe's model to the recipe's numbers is tests/test_megatron_engine.py."""

from __future__ import annotations

import pytest
import torch

from recipe.megatron import cpu_patches as engine
from recipe.megatron.versions import megatron_version

pytestmark = pytest.mark.stack_dependent

PATCH_NAMES = [p.name for p in engine.PATCHES]


def _patch(name: str) -> engine.Patch:
    return next(p for p in engine.PATCHES if p.name == name)


@pytest.mark.parametrize("name", PATCH_NAMES)
def test_each_patch_is_still_needed_at_its_recorded_lines(name):
    """Fails when megatron moves or drops a CUDA-only call: move the lines, or remove the patch
    for a release that no longer makes the call."""
    patch = _patch(name)
    version = megatron_version()
    assert version in patch.lines, f"{name}: no lines recorded for megatron-core {version}"
    expected = patch.lines[version]
    found = patch.found_lines()
    assert found == expected, (
        f"{name}: {patch.module} makes the call at {found}, recorded {expected} for {version}"
        + ("" if found else ": megatron no longer needs this patch on this release")
    )
    assert patch.still_needed() is bool(expected)


def test_the_current_stream_site_is_new_in_0_19():
    expected = {"0.16.1": False, "0.19.2": True}[megatron_version()]
    assert _patch("grad_buffer_current_stream").still_needed() is expected


def test_the_unpatched_calls_raise_without_cuda():
    """The premise of every patch: on this machine each neutralised call fails as written."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the patches are not applied")
    calls = {
        "zeros on cuda": lambda: torch.zeros([], dtype=torch.int, device="cuda"),
        "tensor on cuda": lambda: torch.tensor([1.0], device="cuda"),
        "cuda.synchronize": torch.cuda.synchronize,
        "cuda.current_stream": torch.cuda.current_stream,
        "Tensor.cuda": lambda: torch.zeros(1).cuda(),
    }
    for what, call in calls.items():
        with pytest.raises((RuntimeError, AssertionError)):
            call()
            pytest.fail(f"{what} ran without CUDA")
    assert torch.zeros(1).type() == "torch.FloatTensor"  # what the type-string checks refuse


def test_patches_apply_once_and_change_only_calls_that_would_raise():
    if torch.cuda.is_available():
        assert engine.install_cpu_patches() is False
        return
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert engine.install_cpu_patches() is True
    proxy = schedules.torch
    clip = optimizer.clip_grad_by_total_norm_fp32
    assert engine.install_cpu_patches() is True
    assert schedules.torch is proxy and optimizer.clip_grad_by_total_norm_fp32 is clip
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.zeros(2, device="meta").device.type == "meta"  # others untouched
    assert schedules.torch.Tensor is torch.Tensor and schedules.torch.int is torch.int
    p2p_communication.torch.cuda.synchronize()
    param_and_grad_buffer.torch.cuda.current_stream().wait_stream(torch.cpu.current_stream())
    assert clip_grads.torch.tensor([1.0], device="cuda").device.type == "cpu"
    assert torch.zeros is not schedules.torch.zeros  # the real torch is left alone


def test_the_type_shim_lasts_only_for_the_call():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the patches are not applied")
    engine.install_cpu_patches()
    from megatron.core.optimizer import optimizer

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    optimizer.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert param.grad.tolist() == pytest.approx([0.5, 0.5, 0.5])  # 2 * 1 / (4 + 1e-6)
    assert "type" not in param.grad.__dict__
    assert param.grad.type() == "torch.FloatTensor"
