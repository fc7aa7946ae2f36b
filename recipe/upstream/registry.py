"""Every library the checker knows: its PyPI distribution, the functions checked, and the
releases `python -m recipe.check_upstream --all` checks.

verl's and Megatron-Bridge's zigzag functions are also the ones training can call
(`cp.preprocess=LIBRARY@VERSION`, `adapters.py`); the others have contracts of their own (a
contiguous layout, a packer, attention spans, an MTP shift), each in its own module.
megatron-core's MTP `roll_tensor` runs on real ranks, so its runner is in `recipe/checks/`.
"""

from __future__ import annotations

from recipe.upstream import (
    adapters,
    areal,
    bridge_families,
    ms_swift,
    nemo_automodel,
    ring_flash_attn,
    verl_bshd,
    yunchang,
)
from recipe.upstream.checked import Library
from recipe.upstream.source import UpstreamUnavailable

MEGATRON_CORE = "megatron-core"


def _with_targets(library: Library, extra: tuple) -> Library:
    return Library(library.distribution, (*library.targets, *extra), library.releases)


REGISTRY: dict[str, Library] = {
    "verl": _with_targets(adapters.LIBRARIES["verl"], verl_bshd.TARGETS),
    "megatron-bridge": _with_targets(
        adapters.LIBRARIES["megatron-bridge"], bridge_families.TARGETS
    ),
    **ms_swift.LIBRARIES,  # ms-swift, and mcore-bridge where its CP split lives
    "areal": areal.LIBRARY,
    "nemo-automodel": nemo_automodel.LIBRARY,
    "ring-flash-attn": ring_flash_attn.LIBRARY,
    "yunchang": yunchang.LIBRARY,
}


def known() -> str:
    return ", ".join([*REGISTRY, MEGATRON_CORE])


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`LIBRARY[@VERSION]` -> (library, version or None for the installed release)."""
    library, _, version = spec.partition("@")
    if library not in REGISTRY:
        raise UpstreamUnavailable(f"unknown library {library!r}; known: {known()}")
    return library, (None if version in ("", "installed") else version)
