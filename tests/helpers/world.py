"""A world of one process with megatron's parallel state, for building models in tests."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def lone_world(seed: int = 0):
    """Initialise a lone process group and megatron's state; tear both down afterwards."""
    from recipe.model.cpu_compat import apply_cpu_compat, seed_model_parallel_rng
    from recipe.parallel import groups

    apply_cpu_compat()
    layout = groups.init_distributed()
    try:
        seed_model_parallel_rng(seed)
        yield layout
    finally:
        groups.shutdown_distributed()
