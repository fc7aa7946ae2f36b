"""Make megatron-core run on a machine without CUDA.

megatron-core asks `torch.cuda.current_device()` for a device in a few places that also run on
CPU (RoPE moves its inverse frequencies there on every forward; the MTP loss tracker, the global
memory buffer and DDP buffers allocate there): answering "cpu" makes the model run. For bf16
autocast, megatron's linear autograd functions are wrapped in `torch.amp.custom_fwd/custom_bwd`
for device "cuda" only, so on CPU their backward runs outside autocast and multiplies a bf16
gradient with an fp32 weight; they are re-wrapped for device "cpu". Both patches are applied here
and nowhere else, and only when CUDA is absent, so GPU runs are untouched.
"""

from __future__ import annotations

import torch

from recipe.environment import cuda_available

_PATCHED = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply_cpu_compat() -> bool:
    """Patch megatron-core's CUDA device lookups to the CPU when no GPU exists. Idempotent.

    Returns True when the patch is active.
    """
    global _PATCHED
    if cuda_available():
        return False
    if not _PATCHED:
        torch.cuda.current_device = _cpu_device
        _autocast_linear_functions_on_cpu()
        _PATCHED = True
    return True


def _autocast_linear_functions_on_cpu() -> None:
    from megatron.core.tensor_parallel import layers

    for name in ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight"):
        function = getattr(layers, name)
        # custom_fwd/custom_bwd keep the undecorated function as __wrapped__ (functools.wraps).
        forward = getattr(function.forward, "__wrapped__", function.forward)
        backward = getattr(function.backward, "__wrapped__", function.backward)
        function.forward = staticmethod(torch.amp.custom_fwd(forward, device_type="cpu"))
        function.backward = staticmethod(torch.amp.custom_bwd(backward, device_type="cpu"))


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker.

    On CPU the default tracker fails on `torch.cuda.get_rng_state()`; the inference tracker is a
    no-op that works everywhere. The recipe uses no dropout, so nothing draws from it.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda_available())
