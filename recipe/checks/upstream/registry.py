"""Every library the checker knows: its PyPI distribution, the functions checked, and the
releases `python -m recipe.check_upstream --all` checks.

A library is a plugin: one module under `libraries/` (its data, at most one checked class) and
one line below. verl's and Megatron-Bridge's zigzag functions are also the ones training can
call (`cp.preprocess=LIBRARY@VERSION`, `recipe/upstream/releases.py`); the others have contracts
of their own (a contiguous layout, a packer, attention spans, an MTP shift). megatron-core's MTP
`roll_tensor` runs on real ranks, so its runner is `recipe/checks/mtp_roll.py`.
"""

from __future__ import annotations

from recipe.checks.upstream.kit.registry import Registry
from recipe.checks.upstream.libraries import (
    areal,
    axolotl_ringmaster,
    colossalai,
    deepspeed_ulysses,
    fla,
    megatron_bridge,
    ms_swift,
    nemo_automodel,
    openrlhf,
    ring_flash_attn,
    torch_load_balancers,
    verl,
    yunchang,
)
from recipe.upstream import releases

MEGATRON_CORE = "megatron-core"

# One line per library; the order is the --all table's.
REGISTRY = Registry()
REGISTRY.register("verl", verl.LIBRARY)
REGISTRY.register("megatron-bridge", megatron_bridge.LIBRARY)
REGISTRY.register("ms-swift", ms_swift.LIBRARY)
REGISTRY.register("mcore-bridge", ms_swift.MCORE_BRIDGE)  # where ms-swift's CP split lives
REGISTRY.register("areal", areal.LIBRARY)
REGISTRY.register("nemo-automodel", nemo_automodel.LIBRARY)
REGISTRY.register("ring-flash-attn", ring_flash_attn.LIBRARY)
REGISTRY.register("yunchang", yunchang.LIBRARY)
REGISTRY.register("colossalai", colossalai.LIBRARY)
REGISTRY.register("axolotl-ringmaster", axolotl_ringmaster.LIBRARY)
REGISTRY.register("openrlhf", openrlhf.LIBRARY)
REGISTRY.register("fla-core", fla.LIBRARY)
REGISTRY.register("deepspeed", deepspeed_ulysses.LIBRARY)
REGISTRY.register("torch", torch_load_balancers.LIBRARY)


def known() -> str:
    return ", ".join([*REGISTRY, MEGATRON_CORE])


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`LIBRARY[@VERSION]` of the checker -> (library, version or None for the installed one)."""
    return releases.parse_spec(spec, REGISTRY)
