"""What differs between supported releases of megatron-core (0.16.1, 0.19.2) and Transformer
Engine, probed in one place.

The rest of the recipe calls these functions and never checks a version itself. Each difference
is detected by the feature it concerns (an attribute, a line of the installed source) rather than
by a version number, so a release in between behaves by what it actually does.

- MTP gradient with per-token losses: 0.19 (Megatron-LM PR #3159) multiplies each rank's
  per-token MTP loss by the LOCAL ratio `original_num_tokens / num_tokens` of its micro-batch
  (`process_mtp_loss`); `mtp_loss_has_local_token_ratio` says whether the installed one does
  (`recipe/model/mtp.py` divides it back out under `mtp.scaling=exact`).
- Transformer Engine's context-parallel attention supports packed (THD) batches with p2p in every
  2.x, with a2a from 2.10 and with all_gather from 2.15 (the asserts in TE's
  `attention/dot_product_attention/context_parallel.py`).
"""

from __future__ import annotations

import functools
import inspect

SUPPORTED_MEGATRON = ("0.16.1", "0.19.2")


def megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:  # a source checkout (e.g. inside an NGC image)
        from megatron.core.package_info import __version__

        return __version__


@functools.cache
def mtp_loss_has_local_token_ratio() -> bool:
    """Whether megatron scales each rank's MTP loss by its local token ratio (PR #3159)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    process = getattr(mtp, "process_mtp_loss", None)
    return process is not None and "original_num_tokens" in inspect.getsource(process)


TE_THD_CP_MIN_VERSION = {"p2p": (2, 0), "a2a": (2, 10), "all_gather": (2, 15)}


def transformer_engine_version() -> tuple[int, int] | None:
    """(major, minor) of the installed Transformer Engine, or None without one."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            major, minor = version(name).split(".")[:2]
            return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
        except (PackageNotFoundError, ValueError):
            continue
    return None


def check_te_cp_comm_type(comm_type: str, te_version: tuple[int, int] | None) -> None:
    """Refuse a CP communication type the installed Transformer Engine cannot run on THD."""
    from recipe.errors import ConfigError

    needed = TE_THD_CP_MIN_VERSION[comm_type]
    if te_version is not None and te_version < needed:
        have = ".".join(map(str, te_version))
        raise ConfigError(
            f"cp.comm_type={comm_type} with packed sequences needs Transformer Engine >= "
            f"{needed[0]}.{needed[1]}, this one is {have}; use cp.comm_type=p2p (every 2.x)"
        )
