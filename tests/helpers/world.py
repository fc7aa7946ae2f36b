"""A world of one process with megatron's parallel state, for building models in tests."""

from recipe.launch.local import lone_world

__all__ = ["lone_world"]
