"""What the GPU check's parts share: `Skip` (a part that cannot run here), `PartProgress`
(where a running part is) and `following_training_steps`, the small configuration the parts
train and run (`SMALL`, `part_config`), the bf16 tolerances, the kernel name recorded for
Transformer Engine's attention, `need_te`, and `ran_with` (what a part ran with, as the report
shows it)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

RTOL_BF16 = 2e-2
# Per-token |difference| of next-token losses (nats) that a bf16 forward may show between two
# implementations of the same model; the fp32 gate is the recipe's own (recipe.names).
TOKEN_ATOL_BF16 = 0.1

TE_KERNEL = "te"
"""The kernel recorded for attention that Transformer Engine ran (it picks its own)."""

# A small model and corpus: each part runs in seconds, the 1B preset only where it is the point.
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=512",
    "data.max_seq_len=512",
    "data.markov.mean_doc_len=150",
    "data.markov.max_doc_len=500",
    "data.markov.num_train_docs=600",
    "data.markov.num_eval_docs=20",
    "batching.tokens_per_step=4096",
    "batching.max_tokens_per_rank=4096",
    "trainer.eval_every=0",
    "trainer.progress_bar=false",
    "logger.wandb.mode=disabled",
]


def part_config(overrides: list[str], small: bool = True):
    from recipe.launch.compose import compose_typed

    base = SMALL if small else ["trainer.progress_bar=false", "logger.wandb.mode=disabled"]
    return compose_typed(base + overrides)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


@dataclass
class PartProgress:
    """Where a running part is, kept up to date by the part: what the report of an
    out-of-memory error says. Also the attention kernels this process's recording cannot see
    (Transformer Engine's, other ranks')."""

    doing: str = ""
    step: int | None = None
    """The training step under way (in-process training: `following_training_steps`)."""
    lengths: list[int] | None = None
    """The sequence lengths of the micro-batch or step under way."""
    kernels: set[tuple[str, str]] = field(default_factory=set)
    """(dtype, kernel) pairs to add to what `recording_attention_kernels` saw."""

    def at(self, doing: str, lengths=None, step: int | None = None) -> None:
        self.doing = doing
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.step = step


@contextlib.contextmanager
def following_training_steps(progress: PartProgress):
    """Keep `progress.step` and `.lengths` on the step in-process training is running.

    `train(cfg)` builds its Trainer inside, so the one seam to watch is the class's per-step
    forward/backward; wrapped here for the duration only, and it changes nothing it passes on."""
    from recipe.training.trainer import Trainer

    original = Trainer.forward_backward_step

    def followed(trainer, work, *args, **kwargs):
        progress.step = trainer.step
        progress.lengths = [int(n) for n in work.lengths]
        return original(trainer, work, *args, **kwargs)

    Trainer.forward_backward_step = followed
    try:
        yield progress
    finally:
        Trainer.forward_backward_step = original


def need_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise Skip(f"Transformer Engine is not installed ({err})") from None
    return te


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def nccl_version() -> tuple[int, ...] | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a torch built without NCCL
        return None
    return tuple(version) if isinstance(version, tuple) else (version,)


def dotted(version) -> str | None:
    return ".".join(map(str, version)) if version else None


def ran_with(**what) -> dict:
    """What a part ran with, always the same keys first: the report is read by people."""
    from recipe.megatron.versions import megatron_version, transformer_engine_version

    return {
        "torch": torch.__version__,
        "megatron_core": megatron_version(),
        "transformer_engine": dotted(transformer_engine_version()),
        **what,
    }
