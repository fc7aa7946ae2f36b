"""What differs between supported releases of megatron-core (0.16.1, 0.19.2) and Transformer
Engine, in one place.

The rest of the recipe calls these functions and never checks a version itself. Each difference
is detected by the feature it concerns (an attribute, a line of the installed source) rather than
by a version number, so a release in between behaves by what it actually does.

- MTP loss logging: 0.16 keeps the per-layer mean in `tracker["values"]`, 0.19 in
  `tracker["loss_values"]` (plus acceptance counts).
- MTP gradient with per-token losses: megatron hands every MTP target one backward scale, the
  class attribute `MTPLossAutoScaler.main_loss_backward_scale`, for all MTP layers alike. 0.16
  applies it as is; 0.19 (Megatron-LM PR #3159) first multiplies each rank's per-token MTP loss by
  the LOCAL ratio `original_num_tokens / num_tokens` of its micro-batch (`process_mtp_loss`),
  which makes the trained model depend on how tokens fall on ranks. `mtp.scaling=exact` replaces
  the autoscaler at its call site by one that takes a scale per MTP layer (`prepare_mtp_backward`),
  chosen so that every target of layer k weighs 1 / (global count of layer k), the local ratio
  divided back out where the release applies it. `mtp.scaling=upstream` leaves the release's
  behaviour alone.
- GPTModel is deprecated in 0.19 in favour of HybridModel but still supported there; its warning
  on every model build is silenced.
- Transformer Engine's context-parallel attention supports packed (THD) batches with p2p in every
  2.x, with a2a from 2.10 and with all_gather from 2.15 (the asserts in TE's
  `attention/dot_product_attention/context_parallel.py`).
"""

from __future__ import annotations

import contextlib
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
    key = "loss_values" if "loss_values" in tracker else "values"
    if key not in tracker:
        return torch.zeros(num_layers, dtype=torch.float64)
    means = tracker[key].detach().double().clone()  # stays on the device: no host sync
    # Emptied rather than zeroed (megatron's own clean-up keeps the tensors): megatron sizes them
    # on first use, so a later model with more MTP layers in the same process (a sweep over
    # mtp.num_layers in one Hydra process) would index past them.
    tracker.clear()
    return means


_pending_layer_scales: list[torch.Tensor] = []
"""Per MTP layer of the coming forward, the backward scale its autoscaler takes (exact mode)."""


@functools.cache
def _per_layer_autoscaler():
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    class PerLayerMTPLossAutoScaler(MTPLossAutoScaler):
        """megatron's autoscaler, but each call (one per MTP layer, in layer order) takes its own
        backward scale from the queue filled by `prepare_mtp_backward`; with an empty queue
        (mtp.scaling=upstream, evaluation) it is megatron's: one class-wide scale."""

        @staticmethod
        def forward(ctx, output: torch.Tensor, mtp_loss: torch.Tensor):
            ctx.save_for_backward(mtp_loss)
            ctx.layer_scale = _pending_layer_scales.pop(0) if _pending_layer_scales else None
            return output

        @staticmethod
        def set_loss_scale(scale: torch.Tensor):
            # megatron's schedule sets the scale through the name its module now binds to this
            # class; keep it where the backward below (and megatron's own class) reads it
            MTPLossAutoScaler.main_loss_backward_scale = scale

        @staticmethod
        def backward(ctx, grad_output: torch.Tensor):
            (mtp_loss,) = ctx.saved_tensors
            scale = ctx.layer_scale
            if scale is None:
                scale = MTPLossAutoScaler.main_loss_backward_scale
            return grad_output, torch.ones_like(mtp_loss) * scale.to(mtp_loss.device)

    return MTPLossAutoScaler, PerLayerMTPLossAutoScaler


def install_exact_mtp_scaling() -> None:
    """Swap megatron's MTP autoscaler for the per-layer one where megatron calls it (the GPT
    model on 0.16, `process_mtp_loss` on 0.19). Idempotent; harmless for later upstream runs."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    original, per_layer = _per_layer_autoscaler()
    for module in (gpt_model, multi_token_prediction):
        if getattr(module, "MTPLossAutoScaler", None) is original:
            module.MTPLossAutoScaler = per_layer


def mtp_layer_backward_scales(
    global_layer_counts: list[int] | torch.Tensor,
    local_lm_count: torch.Tensor,
    local_layer_counts: torch.Tensor,
) -> torch.Tensor:
    """[num_layers] backward scale per MTP layer for one micro-batch on this rank, so that each
    target of layer k weighs exactly 1 / (global count of layer k over the step).

    `local_lm_count` is the micro-batch's loss-mask count on this rank (megatron's
    `original_num_tokens`), `local_layer_counts` each layer's count (`num_tokens`). A layer with no
    target anywhere gets 0. Given the global counts as a tensor on the counts' device (the
    trainer copies them once per step), nothing here waits for the host.
    """
    device = local_layer_counts.device
    counts = torch.as_tensor(global_layer_counts, dtype=torch.float64, device=device)
    scales = torch.where(counts > 0, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    if mtp_loss_has_local_token_ratio():
        # megatron multiplies by local_lm / clamp(local_k, 1); multiply by its inverse.
        local_ratio = local_layer_counts.double().clamp(min=1) / local_lm_count.double().clamp(
            min=1
        )
        scales = scales * local_ratio
    return scales.float()


def prepare_mtp_backward(
    scaling: str,
    global_lm_count: int,
    global_layer_counts: list[int] | torch.Tensor,
    local_lm_count: torch.Tensor,
    local_layer_counts: torch.Tensor,
    gradient_divisor: float | None = None,
) -> None:
    """Before the forward of one training micro-batch: set what megatron's MTP autoscaler gives
    the MTP targets at backward time.

    exact: per layer, `mtp_layer_backward_scales` (needs `install_exact_mtp_scaling`), times
    `gradient_divisor` when the engine divides every gradient by it after backward (megatron's).
    upstream: what megatron's own schedule does with per-token losses: a scale of 1 and every
    gradient divided by the step's global main-loss count (`finalize_model_grads`). The recipe's
    engine (`gradient_divisor` None) folds that into the one scale; on megatron's engine its own
    schedule sets the scale.
    """
    original, _ = _per_layer_autoscaler()
    _pending_layer_scales.clear()
    if scaling == "exact":
        scales = mtp_layer_backward_scales(global_layer_counts, local_lm_count, local_layer_counts)
        if gradient_divisor is not None:
            scales = scales * gradient_divisor
        _pending_layer_scales.extend(scales.unbind())
    elif gradient_divisor is not None:
        return
    else:
        # Set on megatron's class itself: its `set_loss_scale` looks the class up by module name,
        # which after `install_exact_mtp_scaling` is the subclass.
        original.main_loss_backward_scale = torch.tensor(1.0 / max(global_lm_count, 1))


def confirm_mtp_backward_taken() -> None:
    """After the forward: every queued per-layer scale must have been taken by an MTP layer.
    Left over means megatron no longer calls the autoscaler the recipe replaced, and the MTP
    gradient would silently be megatron's, not the exact one."""
    if _pending_layer_scales:
        left = len(_pending_layer_scales)
        _pending_layer_scales.clear()
        raise RuntimeError(
            f"mtp.scaling=exact: {left} MTP layer scale(s) were not taken by megatron's MTP "
            "autoscaler; this megatron-core calls it elsewhere. Use mtp.scaling=upstream or "
            "update recipe/model/compat.py"
        )


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


@contextlib.contextmanager
def captured_token_losses(model):
    """Every per-token loss the model computes in the forward passes inside the block, in call
    order: megatron computes each MTP depth's loss with the model's own
    `compute_language_model_loss` (looked up on the instance in 0.16 and 0.19), before the
    main next-token loss. Yields the list the [b, s] losses are appended to."""
    original = model.compute_language_model_loss
    seen: list[torch.Tensor] = []

    def keep(labels, logits):
        loss = original(labels, logits)
        seen.append(loss.detach())
        return loss

    model.compute_language_model_loss = keep
    try:
        yield seen
    finally:
        del model.compute_language_model_loss
