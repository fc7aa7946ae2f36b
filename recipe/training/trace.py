"""Activation and gradient traces of one step, in global token order, for first-divergence search.

For the steps in `trainer.trace_steps` forward hooks on every module of the model keep each
module's output on every real token (padding excluded), tagged with the token's step-level
sample and position (from the zigzag index, not from position_ids) and its `room`, how many tokens
of its sequence follow it (MTP depth k has a target only where room > k); after the gradient
all-reduce every parameter's gradient is kept too. Rank 0 gathers the ranks' pieces, sorts each
module's rows into (sample, position) order and writes `<run dir>/trace/step_NNNNNNNN.pt`
(recipe/rundir/traces.py). Two runs at different layouts then line up row for row and
`python -m recipe.compare.diverge A B` names the first module, in execution order, where they
part. Meant for small models: every activation of the step is kept (hidden 64, 4k tokens, 30
modules: about 60 MB).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from recipe.parallel.cp.zigzag import local_token_identity

# Modules whose output is a table (rope) or per-patch values (the vision encoder), not per-token
# values, though one of its sizes may equal the token count.
_NOT_PER_TOKEN = ("rotary_pos_emb", "vision_")


class ActivationTrace:
    """Forward hooks on every named module of `model`; call `micro_batch` before each forward."""

    def __init__(self, model, layout):
        self.layout = layout
        self.order: list[str] = []
        self.rows: dict[str, list[tuple]] = defaultdict(list)
        self._calls: dict[str, int] = defaultdict(int)
        self._tokens = 0
        self._real = self._sample = self._position = None
        self._handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in model.named_modules()
            if name and not any(part in name for part in _NOT_PER_TOKEN)
        ]

    def micro_batch(self, batch, samples: list[int]) -> None:
        sequence, position, _ = local_token_identity(
            batch.cu_seqlens_padded.cpu(), self.layout.cp_size, self.layout.cp_rank
        )
        real_lengths = batch.cu_seqlens.cpu().to(torch.int64).diff()
        self._real = position < real_lengths[sequence]
        self._sample = torch.tensor(samples, dtype=torch.int64)[sequence][self._real]
        self._position = position[self._real]
        self._room = (real_lengths[sequence] - 1 - position)[self._real]
        self._tokens = position.numel()
        self._calls.clear()

    def _hook(self, name: str):
        def keep(module, inputs, output):
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(tensor, torch.Tensor) or self._real is None:
                return
            dims = [d for d in range(min(tensor.dim(), 2)) if tensor.shape[d] == self._tokens]
            if not dims:
                return
            calls = self._calls[name]
            self._calls[name] += 1
            key = name if calls == 0 else f"{name}#{calls + 1}"  # MTP calls the embedding again
            if key not in self.rows:
                self.order.append(key)
            values = tensor.detach().movedim(dims[0], 0).reshape(self._tokens, -1)
            values = values.double().cpu()[self._real]
            self.rows[key].append((self._sample, self._position, values, self._room))

        return keep

    def close(self) -> dict:
        """This rank's trace: execution order and, per module, (sample, position, values)."""
        for handle in self._handles:
            handle.remove()
        modules = {
            name: tuple(torch.cat([part[i] for part in parts]) for i in range(4))
            for name, parts in self.rows.items()
        }
        return {"order": self.order, "modules": modules}


def gradients_of(model) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().double().cpu().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
