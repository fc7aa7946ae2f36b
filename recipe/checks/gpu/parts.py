"""The GPU check's parts, `CHECKS`, in the order they run, and the first of them, versions (what
the machine has). Every part is a function `check_<part>(quick, device, progress, **options)`."""

from __future__ import annotations

import platform

import torch

from recipe.checks.gpu.attention_parts import (
    check_attention_vs_te,
    check_real_offsets,
    check_te_backends,
    check_zigzag_vs_te,
)
from recipe.checks.gpu.model_parts import check_host_syncs, check_model_te_vs_torch
from recipe.checks.gpu.shared import PartProgress, dotted, nccl_version
from recipe.checks.gpu.training_parts import check_bf16_vs_fp32, check_cp2_one_gpu, check_mfu_1b

# --- versions --------------------------------------------------------------------------------


def check_versions(quick: bool, device: torch.device, progress: PartProgress) -> dict:
    from recipe.megatron.versions import megatron_version, transformer_engine_version

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": dotted(nccl_version()),
        "megatron_core": megatron_version(),
        "transformer_engine": dotted(transformer_engine_version()),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "capability": dotted(torch.cuda.get_device_capability(0)) if cuda else None,
        "device": str(device),
    }


CHECKS = {
    "versions": check_versions,
    "te_backends": check_te_backends,
    "zigzag_vs_te": check_zigzag_vs_te,
    "attention_vs_te": check_attention_vs_te,
    "real_offsets": check_real_offsets,
    "model_te_vs_torch": check_model_te_vs_torch,
    "cp2_one_gpu": check_cp2_one_gpu,
    "host_syncs": check_host_syncs,
    "bf16_vs_fp32": check_bf16_vs_fp32,
    "mfu_1b": check_mfu_1b,
}
