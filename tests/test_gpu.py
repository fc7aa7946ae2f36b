"""GPU checks (skipped without CUDA): Transformer Engine attention and nccl ranks agree with the
recipe's own attention and with cp=1, at bf16's tolerance.

Not run on hardware yet: written against TE's and megatron-core's sources (see docs/gpu.md).
"""

from __future__ import annotations

import pytest

from recipe.launch.local import launch_world
from recipe.launch.rank import train
from tests.helpers.config import typed_config

pytestmark = pytest.mark.gpu

# bf16: TE's fused attention takes no fp32; TF32/bf16 arithmetic needs a ~1e-2 tolerance.
COMMON = [
    "trainer.max_steps=3",
    "model.position_embedding_type=learned_absolute",
    "trainer.precision=bf16",
]
BF16_RTOL = 2e-2


def test_te_backend_matches_the_torch_backend():
    pytest.importorskip("transformer_engine")
    torch_run = train(typed_config(COMMON + ["model.attention_backend=torch"]))["history"]
    te_run = train(typed_config(COMMON + ["model.attention_backend=te"]))["history"]
    for a, b in zip(torch_run, te_run):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=BF16_RTOL)


def test_cp2_on_nccl_matches_cp1():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    reference = train(typed_config(COMMON))["history"]
    history = launch_world(typed_config(COMMON + ["cp=2"]))["history"]
    for a, b in zip(reference, history):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=BF16_RTOL)
