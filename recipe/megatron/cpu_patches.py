"""Every patch that lets megatron-core run on a machine without CUDA: one registry, installed
once per process by `install_cpu_patches()`, only when CUDA is absent (GPU runs are untouched).
megatron code is never edited or copied: each site is neutralised FROM OUTSIDE.

Process-wide (the model itself): megatron asks `torch.cuda.current_device()` for a device in a
few places that also run on CPU (RoPE moves its inverse frequencies there on every forward; the
MTP loss tracker, the global memory buffer and DDP buffers allocate there), answered "cpu". For
bf16 autocast, megatron's linear autograd functions are wrapped in `torch.amp.custom_fwd/
custom_bwd` for device "cuda" only, so on CPU their backward would run outside autocast and
multiply a bf16 gradient with an fp32 weight; they are re-wrapped for device "cpu".

Site by site (megatron's own training machinery): `DistributedDataParallel`,
`get_megatron_optimizer` (plain and distributed), `get_forward_backward_func()` (no pipelining,
1F1B) and `finalize_model_grads` run on a CPU with gloo except for a few calls that assume CUDA.
Each site is one entry of `PATCHES`, with its file:line per release and a `still_needed()` probe
that reads the installed source (tests/test_megatron_engine_cpu.py fails when megatron stops
needing a patch, so that it is removed then).

How, narrowest first:

- A call that names the CUDA device (`torch.zeros(..., device="cuda")`, `torch.tensor(...,
  device='cuda')`, `torch.cuda.synchronize()`, `torch.cuda.current_stream()`) is made through the
  module's global `torch`; that one module's `torch` is replaced by `_CpuTorch`, a proxy that hands
  every attribute through to torch except the few the module calls, and those only change a call
  that would otherwise raise (a device of "cuda" becomes the CPU; synchronize and the current
  stream become torch.cpu's, which are no-ops). Nothing else in the process sees the proxy.
- A type-string check (`param.type() == 'torch.cuda.FloatTensor'`, asserted or else a TypeError)
  cannot be reached through a module global: the one function that makes it is wrapped, and
  during that call alone the tensors it checks answer `.type()` with the CUDA name of their own
  type ("torch.FloatTensor" -> "torch.cuda.FloatTensor"), through an instance attribute that is
  deleted afterwards.

Why each is needed (a CUDA-less torch raises on every one: "Found no NVIDIA driver" from a CUDA
build, "Torch not compiled with CUDA enabled" from a CPU build; the type checks raise
AssertionError / TypeError):

- `schedules_token_count`: every schedule counts the step's tokens in a CUDA int tensor
  (`torch.zeros([], dtype=torch.int, device="cuda")`), with or without per-token loss.
- `p2p_synchronize`: with pipelining, the shape exchange of variable-length (THD) micro-batches
  and every batched p2p call end with `torch.cuda.synchronize()`.
- `grad_buffer_current_stream` (0.19 only): `start_grad_sync` asks for the current CUDA stream to
  wait on CUDA-graph events, on every grad reduction.
- `optimizer_cuda_tensors`: the FP32 optimizer's loss scale, the mixed-precision/distributed
  optimizer's found-inf and scale buffers, and (0.19) the grad-norm-group flag are CUDA tensors.
- `clip_grads_cuda_tensors`: the gradient norm and the clip's overflow buffer are CUDA tensors.
- `utils_l2_norm`: without Transformer Engine or Apex, the fallback L2 norm returns a CUDA tensor.
- `clip_grads_type_check`: clipping asserts every gradient is a `torch.cuda.FloatTensor`.
- `distrib_optimizer_type_check`: the distributed optimizer sorts parameters by CUDA type names
  and raises TypeError for any other (a CPU fp32 parameter is "torch.FloatTensor").
- `tied_embedding_cuda` (pp > 1 with tied embeddings): `language_module.py` moves the last stage's
  output-layer weight with `weight.data.cuda()`; neither the module's `torch` nor an instance
  attribute reaches it (`.data` is a new tensor at every access), so the one method that does it
  (`setup_embeddings_and_output_layer`, run once when the model is built) is wrapped and, during
  that call alone, `torch.Tensor.cuda` returns the tensor itself (it would raise otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.environment import cuda_available

_INSTALLED = False


def _on_cpu(device):
    """The CPU for a device that names CUDA; any other device unchanged."""
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _device_to_cpu(function):
    @functools.wraps(function)
    def on_cpu(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return function(*args, **kwargs)

    return on_cpu


class _CudaOnCpu:
    """`torch.cuda` for one megatron module: synchronize and current_stream are torch.cpu's."""

    synchronize = staticmethod(torch.cpu.synchronize)
    current_stream = staticmethod(torch.cpu.current_stream)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """`torch` for one megatron module: `overrides` replace a few attributes, the rest is torch.

    Marked with `_megatron_engine_cpu` so that a second application finds it."""

    _megatron_engine_cpu = True

    def __init__(self, overrides: dict):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _temporary_attribute(tensors, name: str, make: Callable):
    """Give each tensor an instance attribute `name` (made by `make(tensor)`) for the block."""
    given = []
    try:
        for tensor in tensors:
            if tensor is not None and name not in tensor.__dict__:
                setattr(tensor, name, make(tensor))
                given.append(tensor)
        yield
    finally:
        for tensor in given:
            delattr(tensor, name)


def _cuda_type_name(tensor: torch.Tensor):
    """`tensor.type` answering with the CUDA name of the tensor's own type when called bare."""

    def type_(dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = torch.Tensor.type(tensor)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return torch.Tensor.type(tensor, dtype, non_blocking, **kwargs)

    return type_


def _stays_on_cpu(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`Tensor.cuda` where there is no CUDA (it raises there): the tensor itself."""
    return tensor


def _as_list(tensors) -> list:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


# --- the patches ------------------------------------------------------------------------------


def _proxy_torch(module_name: str, top: dict | None = None, cuda: bool = False) -> None:
    module = importlib.import_module(module_name)
    if getattr(module.torch, "_megatron_engine_cpu", False):
        return
    overrides = dict(top or {})
    if cuda:
        overrides["cuda"] = _CudaOnCpu()
    module.torch = _CpuTorch(overrides)


def _patch_schedules() -> None:
    _proxy_torch(
        "megatron.core.pipeline_parallel.schedules", {"zeros": _device_to_cpu(torch.zeros)}
    )


def _patch_p2p() -> None:
    _proxy_torch("megatron.core.pipeline_parallel.p2p_communication", cuda=True)


def _patch_grad_buffer() -> None:
    _proxy_torch("megatron.core.distributed.param_and_grad_buffer", cuda=True)


def _patch_optimizer_tensors() -> None:
    _proxy_torch("megatron.core.optimizer.optimizer", {"tensor": _device_to_cpu(torch.tensor)})


def _patch_clip_grads_tensors() -> None:
    _proxy_torch(
        "megatron.core.optimizer.clip_grads",
        {"tensor": _device_to_cpu(torch.tensor), "zeros": _device_to_cpu(torch.zeros)},
    )


def _patch_utils_l2_norm() -> None:
    _proxy_torch("megatron.core.utils", {"tensor": _device_to_cpu(torch.tensor)})


def _patch_clip_type_check() -> None:
    # optimizer.py imported the function by name: the caller's reference is the one to wrap.
    from megatron.core.optimizer import optimizer

    original = optimizer.clip_grad_by_total_norm_fp32
    if getattr(original, "_megatron_engine_cpu", False):
        return

    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        grads = [getattr(p, "grad", None) for p in _as_list(parameters)]
        with _temporary_attribute(grads, "type", _cuda_type_name):
            return original(parameters, *args, **kwargs)

    clip._megatron_engine_cpu = True
    optimizer.clip_grad_by_total_norm_fp32 = clip


def _patch_distrib_type_check() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__init__
    if getattr(original, "_megatron_engine_cpu", False):
        return

    @functools.wraps(original)
    def __init__(self, optimizer, *args, **kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with _temporary_attribute(params, "type", _cuda_type_name):
            original(self, optimizer, *args, **kwargs)

    __init__._megatron_engine_cpu = True
    DistributedOptimizer.__init__ = __init__


def _patch_tied_embedding() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_megatron_engine_cpu", False):
        return

    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        # `weight.data` is a new tensor at every access: no instance attribute reaches it.
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = _stays_on_cpu
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    setup._megatron_engine_cpu = True
    LanguageModule.setup_embeddings_and_output_layer = setup


# --- the registry -----------------------------------------------------------------------------


def _source(module_name: str) -> str:
    return inspect.getsource(importlib.import_module(module_name))


def find_lines(module_name: str, pattern: str) -> list[int]:
    """1-based lines of the installed module's source that match the regular expression."""
    regex = re.compile(pattern)
    return [n for n, line in enumerate(_source(module_name).splitlines(), 1) if regex.search(line)]


@dataclass(frozen=True)
class Patch:
    """One CUDA-only site of megatron-core and how it is neutralised on a CPU."""

    name: str
    module: str
    """The megatron module whose code makes the call."""
    neutralises: str
    lines: dict
    """megatron-core release -> the lines of `module` that make the call (empty: not there)."""
    pattern: str
    """A regular expression for those lines in the installed source."""
    apply: Callable[[], None]

    def found_lines(self) -> list[int]:
        return find_lines(self.module, self.pattern)

    def still_needed(self) -> bool:
        """Whether the installed megatron still makes the call this patch neutralises."""
        return bool(self.found_lines())


_CUDA_DEVICE = r"device=['\"]cuda['\"]"

PATCHES: list[Patch] = [
    Patch(
        "schedules_token_count",
        "megatron.core.pipeline_parallel.schedules",
        "torch.zeros(..., device='cuda') counting the step's tokens (no pipelining, interleaved, "
        "1F1B), through a module-level torch proxy whose zeros puts 'cuda' on the CPU",
        {"0.16.1": [596, 983, 2138], "0.19.2": [749, 1121, 2292]},
        r"torch\.zeros\(.*" + _CUDA_DEVICE,
        _patch_schedules,
    ),
    Patch(
        "p2p_synchronize",
        "megatron.core.pipeline_parallel.p2p_communication",
        "torch.cuda.synchronize() after the THD shape exchange and after batched p2p (pp > 1), "
        "through a torch proxy whose cuda.synchronize is torch.cpu.synchronize",
        {"0.16.1": [242, 398], "0.19.2": [263, 419]},
        r"torch\.cuda\.synchronize\(\)",
        _patch_p2p,
    ),
    Patch(
        "grad_buffer_current_stream",
        "megatron.core.distributed.param_and_grad_buffer",
        "torch.cuda.current_stream() in start_grad_sync (waits on CUDA-graph events), through a "
        "torch proxy whose cuda.current_stream is torch.cpu.current_stream",
        {"0.16.1": [], "0.19.2": [632]},
        r"current_stream = torch\.cuda\.current_stream\(\)",
        _patch_grad_buffer,
    ),
    Patch(
        "optimizer_cuda_tensors",
        "megatron.core.optimizer.optimizer",
        "torch.tensor(..., device='cuda') for the grad-norm-group flag (0.19), the mixed-precision "
        "and distributed optimizer's found_inf/overflow/scale-one buffers and the FP32 optimizer's "
        "scale, through a torch proxy whose tensor puts 'cuda' on the CPU",
        {"0.16.1": [473, 481, 485, 907], "0.19.2": [315, 690, 698, 702, 1249]},
        r"torch\.tensor\(.*" + _CUDA_DEVICE,
        _patch_optimizer_tensors,
    ),
    Patch(
        "clip_grads_cuda_tensors",
        "megatron.core.optimizer.clip_grads",
        "torch.tensor/torch.zeros(..., device='cuda') for the gradient norm, the clip's overflow "
        "buffer and the zero count, through a torch proxy that puts 'cuda' on the CPU",
        {"0.16.1": [90, 103, 115, 174, 207], "0.19.2": [96, 108, 112, 180, 231]},
        r"torch\.(tensor|zeros)\(.*" + _CUDA_DEVICE,
        _patch_clip_grads_tensors,
    ),
    Patch(
        "utils_l2_norm",
        "megatron.core.utils",
        "local_multi_tensor_l2_norm's torch.tensor(..., device='cuda') (the norm without "
        "Transformer Engine or Apex), through a torch proxy whose tensor puts 'cuda' on the CPU",
        {"0.16.1": [1207], "0.19.2": [1332]},
        r"l2_cuda = torch\.tensor\(.*" + _CUDA_DEVICE,
        _patch_utils_l2_norm,
    ),
    Patch(
        "clip_grads_type_check",
        "megatron.core.optimizer.clip_grads",
        "assert param.grad.type() == 'torch.cuda.FloatTensor' in clip_grad_by_total_norm_fp32, "
        "by wrapping optimizer.py's reference to it: the grads answer .type() with the CUDA name "
        "during the call",
        {"0.16.1": [167], "0.19.2": [174]},
        r"param\.grad\.type\(\) == 'torch\.cuda\.FloatTensor'",
        _patch_clip_type_check,
    ),
    Patch(
        "distrib_optimizer_type_check",
        "megatron.core.optimizer.distrib_optimizer",
        "model_param.type() == 'torch.cuda.FloatTensor' else TypeError (and the Half/BFloat16 "
        "checks) in DistributedOptimizer.__init__, by wrapping __init__: the parameters answer "
        ".type() with the CUDA name during the call",
        {"0.16.1": [361, 420, 582], "0.19.2": [401, 466, 758]},
        r"(model_)?param\.type\(\) (==|in) \[?'torch\.cuda\.",
        _patch_distrib_type_check,
    ),
    Patch(
        "tied_embedding_cuda",
        "megatron.core.models.common.language_module.language_module",
        "weight.data = weight.data.cuda() for the last stage's tied output layer (pp > 1), by "
        "wrapping setup_embeddings_and_output_layer: during that call alone Tensor.cuda returns "
        "the tensor itself",
        {"0.16.1": [244], "0.19.2": [307]},
        r"weight\.data = weight\.data\.cuda\(\)",
        _patch_tied_embedding,
    ),
]
"""Every CUDA-only site on the paths named in the module docstring, in the order a step meets
them. Sites left alone because the recipe's paths never reach them on a CPU: the nccl_ub warm-up
tensor and the multi-instance communication streams of DDP, the Float16 optimizer's own
`torch.cuda.FloatTensor` branch (bf16 parameters), CPU offloading."""


def install_cpu_patches() -> bool:
    """Install every CPU patch (process-wide, then each site of `PATCHES`) when no GPU exists.
    Idempotent: the first call of a process installs, later ones only answer. Returns True when
    the patches are active."""
    global _INSTALLED
    if cuda_available():
        return False
    if not _INSTALLED:
        torch.cuda.current_device = _cpu_device
        _autocast_linear_functions_on_cpu()
        for patch in PATCHES:
            patch.apply()
        _INSTALLED = True
    return True


# --- process-wide -----------------------------------------------------------------------------


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _autocast_linear_functions_on_cpu() -> None:
    from megatron.core.tensor_parallel import layers

    for name in ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight"):
        function = getattr(layers, name)
        # custom_fwd/custom_bwd keep the undecorated function as __wrapped__ (functools.wraps).
        forward = getattr(function.forward, "__wrapped__", function.forward)
        backward = getattr(function.backward, "__wrapped__", function.backward)
        function.forward = staticmethod(torch.amp.custom_fwd(forward, device_type="cpu"))
        function.backward = staticmethod(torch.amp.custom_bwd(backward, device_type="cpu"))


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron's model-parallel RNG tracker.

    On CPU the default tracker fails on `torch.cuda.get_rng_state()`; the inference tracker is a
    no-op that works everywhere. The recipe uses no dropout, so nothing draws from it.
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not cuda_available())
