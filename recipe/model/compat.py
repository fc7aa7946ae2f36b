"""What differs between supported releases of megatron-core (0.16.1, 0.19.2) and Transformer
Engine, in one place.

The rest of the recipe calls these functions and never checks a version itself. Each difference
is detected by the feature it concerns (an attribute, a line of the installed source) rather than
by a version number, so a release in between behaves by what it actually does.

- MTP loss logging: 0.16 keeps the per-layer mean in `tracker["values"]` and resets it with
  `clean_loss_in_tracker`; 0.19 keeps `tracker["loss_values"]` (plus acceptance counts) and resets
  with `clean_metrics_in_tracker`.
- MTP gradient with per-token losses: 0.19 (Megatron-LM PR #3159) multiplies each rank's
  per-token MTP loss by the LOCAL ratio `original_num_tokens / num_tokens` of its micro-batch
  (`process_mtp_loss`), which makes the trained model depend on how tokens fall on ranks. The
  recipe wants every MTP target weighted by 1 / (global count of the first MTP layer), as on 0.16;
  the backward scale handed to megatron divides the local ratio back out. For the first MTP layer
  this is exact on both releases; deeper layers on 0.19 keep a factor num_1 / num_k of local
  counts (exact when every rank holds whole sequences, as at cp=1 and dp=1).
- GPTModel is deprecated in 0.19 in favour of HybridModel but still supported there; its warning
  on every model build is silenced.
- Transformer Engine's context-parallel attention supports packed (THD) batches with p2p in every
  2.x, with a2a from 2.10 and with all_gather from 2.15 (the asserts in TE's
  `attention/dot_product_attention/context_parallel.py`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

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


def take_mtp_loss_means(num_layers: int) -> torch.Tensor:
    """The per-layer mean MTP loss megatron tracked during the last forward, then reset it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    key = "loss_values" if hasattr(MTPLossLoggingHelper, "clean_metrics_in_tracker") else "values"
    if key not in tracker:
        return torch.zeros(num_layers, dtype=torch.float64)
    means = tracker[key].detach().double().clone()  # stays on the device: no host sync
    if key == "loss_values":
        MTPLossLoggingHelper.clean_metrics_in_tracker()
    else:
        MTPLossLoggingHelper.clean_loss_in_tracker()
    return means


def mtp_backward_scale(
    global_first_layer_count: int,
    local_lm_count: torch.Tensor,
    local_first_layer_count: torch.Tensor,
) -> torch.Tensor:
    """The gradient megatron must give each MTP target of one micro-batch on this rank so that
    the MTP term is sum / (global count of the first MTP layer), whatever the layout.

    `local_lm_count` is the micro-batch's loss-mask count on this rank (megatron's
    `original_num_tokens`), `local_first_layer_count` its first MTP layer's (`num_tokens`).
    Stays on the counts' device: no host synchronisation.
    """
    if not global_first_layer_count:
        return torch.tensor(0.0)
    scale = torch.tensor(1.0 / global_first_layer_count)
    if not mtp_loss_has_local_token_ratio():
        return scale
    # megatron multiplies by local_lm / clamp(local_first, 1); multiply by its inverse.
    ratio = local_first_layer_count.clamp(min=1) / local_lm_count.clamp(min=1)
    return scale.to(ratio.device) * ratio


class _DropGPTModelDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "GPTModel IS DEPRECATED" not in record.getMessage()


def silence_known_warnings() -> None:
    """GPTModel is what the recipe builds on every supported release; 0.19 warns on each build."""
    logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
    if not any(isinstance(f, _DropGPTModelDeprecation) for f in logger.filters):
        logger.addFilter(_DropGPTModelDeprecation())


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
