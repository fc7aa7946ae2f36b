"""A checkpoint's tensors without a layout: full tp=1 tensors by name, this rank's shard in memory.

Each rank joins its tensor-parallel shards (megatron marks them `tensor_model_parallel` with a
`partition_dim`) into the full tensor before saving, and slices its own shard after loading;
context- and data-parallel ranks hold full copies. So the names and shapes are the same for every
layout, and a state written at cp=2, dp=2 or tp=2 loads at cp=1 and back. Joining the shards
costs one full copy of the model per rank, which suits the model sizes this recipe compares.
"""

from __future__ import annotations

import torch

from recipe.environment import cuda_available
from recipe.errors import ConfigError
from recipe.parallel import collectives


def tp_shard(full: torch.Tensor, partition_dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's contiguous slice of a full tensor along `partition_dim`."""
    if full.shape[partition_dim] % tp_size:
        raise ValueError(
            f"dimension {partition_dim} of size {full.shape[partition_dim]} does not split into "
            f"{tp_size} tensor-parallel shards"
        )
    return full.chunk(tp_size, dim=partition_dim)[tp_rank]


def _partition_dim(param) -> int | None:
    """The dimension megatron shards `param` along, or None for a full copy on every rank."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError(
            "a parameter with partition_stride > 1 (interleaved shards) cannot be joined by "
            "concatenation; the recipe's layer spec has none"
        )
    return param.partition_dim


def full_state(model, optimizer_state: dict, tp_group, names: dict[str, str] | None = None):
    """Weights, AdamW moments and RNG state as tp=1 tensors on the CPU, keyed by name (a
    pipeline stage's parameters by their `names` in the whole model): copies, which later steps
    leave as they are. `optimizer_state` is {parameter: {"exp_avg": ..., ...}} with this rank's
    tp shard of every moment."""
    params = _named_parameters(model, names)
    state: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        state[f"model/{name}"] = _joined(param.detach(), param, tp_group)
    for name, buffer in _persistent_buffers(model).items():
        state[f"model/{name}"] = buffer.detach().cpu().clone()  # full on every rank
    for name, param in params.items():
        for key, value in optimizer_state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                value = _joined(value, param, tp_group)  # a copy, on the CPU
            elif torch.is_tensor(value):
                value = value.detach().to("cpu", copy=True)  # a step count: a copy too
            else:
                value = torch.tensor(value)
            state[f"optim/{name}/{key}"] = value
    state["rng/cpu"] = torch.get_rng_state()
    if cuda_available() and torch.cuda.is_initialized():
        state["rng/cuda"] = torch.cuda.get_rng_state()
    return state


def _named_parameters(model, names: dict[str, str] | None) -> dict[str, torch.nn.Parameter]:
    params = dict(model.named_parameters())
    return {names[n]: p for n, p in params.items()} if names else params


def _persistent_buffers(model) -> dict[str, torch.Tensor]:
    saved = model.state_dict().keys()
    return {name: b for name, b in model.named_buffers() if name in saved}


def _joined(tensor: torch.Tensor, param, tp_group) -> torch.Tensor:
    dim = _partition_dim(param)
    if dim is not None:
        tensor = collectives.all_gather_along(tensor, dim, tp_group)
    return tensor.detach().cpu().clone()


def load_full_state(
    tensors: dict[str, torch.Tensor],
    model,
    tp_rank: int,
    tp_size: int,
    names: dict[str, str] | None = None,
    source: str = "the state",
) -> dict:
    """Load full tensors, as `full_state` made them at any layout (or a checkpoint holds them),
    into this rank's model shard (or pipeline stage, whose parameters' whole-model `names` are
    given); returns the optimizer state for it, {parameter: {"exp_avg": ..., ...}} (this rank's
    tp shard of each moment), and restores the random number generators. `source` says where
    the tensors came from (`checkpoint <path>`) in an error."""
    params = _named_parameters(model, names)

    def local(key: str, param) -> torch.Tensor:
        if key not in tensors:
            raise ConfigError(f"{source} has no {key}: written by another model")
        value = tensors[key]
        dim = _partition_dim(param)
        if dim is not None:
            value = tp_shard(value, dim, tp_rank, tp_size)
        if value.shape != param.shape:
            raise ConfigError(
                f"{source}: {key} has shape {tuple(tensors[key].shape)}, this "
                f"model's (tp={tp_size}) shard needs {tuple(param.shape)}"
            )
        return value

    with torch.no_grad():
        for name, param in params.items():
            param.copy_(local(f"model/{name}", param))
        for name, buffer in _persistent_buffers(model).items():
            buffer.copy_(local(f"model/{name}", buffer))

    moments = {}
    for name, param in params.items():
        prefix = f"optim/{name}/"
        keys = [k for k in tensors if k.startswith(prefix)]
        if not keys:
            continue  # a parameter that never had a gradient has no optimizer state yet
        moments[param] = {
            k[len(prefix) :]: (local(k, param) if tensors[k].dim() else tensors[k]).to(
                param.device if tensors[k].dim() else "cpu"
            )
            for k in keys
        }
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and cuda_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return moments
