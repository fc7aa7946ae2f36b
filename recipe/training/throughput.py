"""Model FLOPs of a packed step and model FLOPs utilisation (MFU).

Counted the usual way (as in Megatron-LM and PaLM's appendix): every weight matrix costs 2 FLOPs
per token and parameter forward, 4 backward (6 per token and parameter), and causal attention
adds, per layer, 12 x hidden FLOPs for every (query, key) pair a token attends to. In a packed
batch a token attends only within its sequence, so a sequence of L tokens has L(L+1)/2 pairs:
the count follows the real lengths, not the padded stream. MFU divides the step's model FLOPs by
its time and the devices' peak; the recipe never counts recomputation or padding as useful work.
With MTP, the output layer that every MTP layer shares is counted once (a small undercount).
"""

from __future__ import annotations

import torch

# Dense bf16 peak per device in TFLOP/s, from the vendors' data sheets (SXM parts); TF32 is half.
PEAK_BF16_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.4,
    "H100": 989.4,
    "H800": 989.4,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}


def linear_parameter_count(model) -> int:
    """Parameters that multiply activations: every weight matrix except input embeddings (a
    lookup), plus the output layer when it shares the word embedding."""
    count = 0
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue  # norms and biases: elementwise
        if "embedding" in name:
            continue
        count += param.numel()
    if getattr(model, "share_embeddings_and_output_weights", False):
        count += model.shared_embedding_or_output_weight().numel()
    return count


def model_flops_per_step(
    lengths: list[int], linear_params: int, hidden_size: int, attention_layers: int
) -> float:
    """Training FLOPs (forward + backward) of one step over sequences of these real lengths."""
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 6.0 * linear_params * tokens + 12.0 * hidden_size * attention_layers * pairs


def device_peak_tflops(device: torch.device, precision: str, override: float | None):
    """Peak TFLOP/s of one device: the user's figure, else the table for known GPUs, else None."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16 in PEAK_BF16_TFLOPS.items():
        if key in name:
            return bf16 if precision == "bf16" else bf16 / 2
    return None
