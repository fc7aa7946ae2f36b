"""Make megatron-core run on a machine without CUDA.

megatron-core 0.16.1 asks `torch.cuda.current_device()` for a device in a few places that also run
on CPU (RoPE moves its inverse frequencies there on every forward; the MTP loss tracker, the global
memory buffer and DDP buffers allocate there). Answering "cpu" is the only patch the model needs;
it is applied here and nowhere else, and only when CUDA is absent, so GPU runs are untouched.
"""

from __future__ import annotations

import torch

_PATCHED = False


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def apply_cpu_compat() -> bool:
    """Patch megatron-core's CUDA device lookups to the CPU when no GPU exists. Idempotent.

    Returns True when the patch is active.
    """
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if not _PATCHED:
        torch.cuda.current_device = _cpu_device
        _PATCHED = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker.

    On CPU the default tracker fails on `torch.cuda.get_rng_state()`; the inference tracker is a
    no-op that works everywhere. The recipe uses no dropout, so nothing draws from it.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
