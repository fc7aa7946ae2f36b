"""Precision and determinism: the switches that decide whether two runs can match to the digit.

Mixed precision is fp32 parameters and optimizer state with `torch.autocast(bfloat16)` around the
forward: matmuls and attention run in bf16, megatron's cross entropy upcasts the logits, and the
master weights, the recipe's AdamW and the initial weights stay exactly those of an fp32 run, on
CPU and GPU alike (one code path; megatron-core supports autocast, and Transformer Engine's and
megatron's linears honour it). The price against megatron's Float16Module + distributed
optimizer is memory: the weights are held once in fp32 and cast per use.

Determinism is one switch for the settings that only work together on a GPU: megatron's
`deterministic_mode`, `NVTE_ALLOW_NONDETERMINISTIC_ALGO=0` (megatron refuses deterministic mode
without it), `CUBLAS_WORKSPACE_CONFIG` and torch's deterministic algorithms.
"""

from __future__ import annotations

import contextlib
import os

import torch

from recipe.errors import ConfigError


def resolve_precision(name: str, device: torch.device) -> str:
    """`auto` is bf16 on a GPU (Transformer Engine's fused attention needs it) and fp32 on CPU."""
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


def autocast(device: torch.device, precision: str):
    """The context the model's forward runs in."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_backend_and_precision(backend: str, precision: str, cuda: bool) -> None:
    """Refuse, before any work, combinations Transformer Engine cannot run."""
    if backend == "te" and not cuda:
        raise ConfigError(
            "model.attention_backend=te needs CUDA and transformer-engine; on this machine use "
            "model.attention_backend=torch (or auto)"
        )
    if backend == "te" and precision == "fp32":
        raise ConfigError(
            "model.attention_backend=te with trainer.precision=fp32: Transformer Engine's "
            "FlashAttention and FusedAttention take only bf16/fp16 and its unfused attention is "
            "disabled for THD under CP; use trainer.precision=bf16 (or auto), or "
            "model.attention_backend=torch for an fp32 run"
        )


def apply_determinism(enabled: bool) -> None:
    """Set the process-wide determinism switches (megatron's own is set in its config). Both
    ways: a process that ran a deterministic job before (gpu_check's parts, a multirun) must not
    keep Transformer Engine off its non-deterministic kernels for a job that wants speed."""
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0" if enabled else "1"
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
