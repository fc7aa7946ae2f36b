"""The host-memory bounds set before training (recipe/host_memory.py): added only where the user
set nothing, none when opted out, and in effect in a run's ranks (that train.py sets them for its
ranks is checked in tests/test_faults.py's stalled-rank test, which launches ranks already)."""

from __future__ import annotations

from recipe.host_memory import HOST_MEMORY_DEFAULTS, OPT_OUT, bound_host_memory


def test_the_defaults_are_added_only_where_the_user_set_nothing():
    environ = {"MALLOC_MMAP_THRESHOLD_": "4194304", "PATH": "/bin"}
    added = bound_host_memory(environ)
    assert added == {k: v for k, v in HOST_MEMORY_DEFAULTS.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    assert environ["MALLOC_MMAP_THRESHOLD_"] == "4194304", "the user's own value stays"
    assert environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    assert bound_host_memory(environ) == {}, "idempotent"


def test_opting_out_leaves_the_libraries_defaults():
    environ = {OPT_OUT: "0"}
    assert bound_host_memory(environ) == {} and environ == {OPT_OUT: "0"}
