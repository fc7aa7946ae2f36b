"""ms-swift and mcore-bridge: the CP split of a packed micro-batch and its inverse, from the wheels.

Where the functions live (read in the wheels, file:line there):
- mcore-bridge 1.6.5 `mcore_bridge/utils/megatron_utils.py`: `split_cp_inputs` (:56), the split
  of one tensor along `dim`, zigzag per sequence of `cu_seqlens` (or the whole dim when it is
  None), or contiguous; `reconstruct_tensor_cp` (:118), all_gather, then megatron-core's
  `_undo_attention_load_balancing`.
- ms-swift 4.6.0 `swift/megatron/utils/megatron_lm_utils.py:858` `get_batch_on_this_cp_rank`:
  mcore-bridge's split on labels, position_ids, loss_scale and (text models) input_ids with
  `packed_seq_params.cu_seqlens_q` (:887). ms-swift keeps two inverses of its own:
  `swift/megatron/utils/utils.py:284` `reconstruct_tensor_cp` (mcore-bridge's code; the last
  tokens of a sequence, trainers/base.py:1138) and `swift/megatron/trainers/utils.py:472`
  `reconstruct_tensor_cp` (its own index arithmetic: per-token logps and entropies for GRPO and
  reference models, trainers/utils.py:467, grpo_trainer.py:906, rlhf_mixin.py:81).
So there are two libraries: "ms-swift" (its batch path and its two inverses, which run on the
mcore-bridge release ms-swift installs) and "mcore-bridge" (its split and inverse alone).
ms-swift 4.6.0 requires `mcore-bridge>=1.6.3` (METADATA, extra "megatron"); 1.6.3 and 1.6.4
move the split's index to CUDA (`.cuda()`, their megatron_utils.py:77-78), 1.6.5 keeps it on the
tensor's device, so the ms-swift targets run on 1.6.5, the newest release the requirement
allows (`BRIDGE_FOR_SWIFT`); an ms-swift release whose requirement excludes it is refused.

What a CP rank trains on in ms-swift, every step the release's own code:
1. the collator `Template._data_collator` (swift/template/base.py:2062, what `data_collator` calls
   for causal_lm in train mode, :1802-1804): `_handle_megatron_cp` (:1665-1682) pads every
   sample to a multiple of 2*cp inside the sample (pad_token_id, labels -100, loss_scale 0,
   length += pad, so its position ids run on through the padding); `packing_row` (:750-771)
   packs the micro-batch into one row, position ids 0..length-1 per sample (:768); the row is
   padded to a multiple of `padding_to` (:2138-2149, :2164-2169): tokens, labels and loss_scale
   on `padding_side`, the position ids always appended on the right as arange(2*cp) repeated,
   so the tail is cut into padding segments of 2*cp. Without padding_free each sample is a row
   of [b, s], padded on the right (:2077-2082 refuses left padding).
   `padding_to` is `get_padding_to(args)` (swift/megatron/utils/utils.py:229-249): cp, times tp
   under sequence parallelism, times 16 for fp8/fp4, 128 for the blockwise recipe, 32 for mxfp8,
   at least 64 times that cp (or cp*tp) for the fused attention backend.
2. `prepare_batch` (swift/megatron/trainers/utils.py:379): `get_batch_on_this_pp_rank` rolls
   labels and loss_scale by -1 along the row (:22-24), so each slot's label is the next token
   and a sample's last token gets the -100 of what follows it; the packed_seq_params come from
   the position ids (utils.py:252 -> swift/utils/transformers_utils.py:354: a sequence starts at
   every position id 0, so cu_seqlens_q holds each sample's padded boundaries and then the tail's
   segments); then `get_batch_on_this_cp_rank`.
3. the loss weight of a slot is `labels != -100` times loss_scale (trainers/trainer.py:59-63).

Ground truth: zigzag -> the contract (`recipe/parallel/cp/contract.py`, `assess`) on the
sequences' slots (each sample's padded boundaries, as the function returns them), plus a check
that the tail segments hold no real token and no loss weight; contiguous -> rank r holds global
slots [r*T/cp, (r+1)*T/cp) of the row (`_contiguous_problem`). The inverses: a round trip (every
rank shards a tensor of unique values with the split, every rank gathers it back through the
function, with all_gather played by a stand-in that hands each rank's shard back) must give the
original; a real token's value elsewhere is misplaced, nowhere is lost, padding alone is padding.

Options, drawn or fixed (every attribute the released code reads from `args` and the template is
one of these: any other refuses the check, see `_Strict`):
- drawn (batch path and ms-swift inverses): padding_free, padding_side, sequence_parallel,
  fp8_format, fp8_recipe, fp4_format, attention_backend (the last five set padding_to), and for
  the batch path is_multimodal (input_ids stay whole: the model splits embeddings; positions,
  labels and weights are checked), cp_partition_mode (zigzag, contiguous), loss_scale (absent,
  or the template's per-token weights); tp comes from the case.
- fixed: task_type causal_lm (seq_cls, embedding and reranker carry one label per sample, which
  the split leaves whole, :884-885); the NPU branches off (`is_torch_npu_available` answers
  False: an Ascend path, utils.py:277, megatron_lm_utils.py:889, trainers/utils.py:359); one
  pipeline stage (earlier stages drop the labels, trainers/utils.py:26-32); train mode (other
  modes pad on the left for generation); 1-D position ids (text models; mrope's 3-D ones go
  through the same lines along the last dim); pad_token_id 0 (never a real token here).
- the inverses: dim with the tensor's layout (`bsh:1` [b, s, h] along 1, as trainers/base.py
  passes the model output; `bs:1`, `bs:-1`, `sbh:0`), cp_partition_mode and packed or row
  batches drawn; ms-swift's trainer inverse takes [b, s] logps along 1 (fixed by its callers)
  and num_samples = the real sample count its callers pass (seq_lens, trainers/utils.py:461).
  mcore-bridge's inverse leaves cu_seqlens_q_padded None (ms-swift sets it only on NPU, to the
  same boundaries).

Stubs (imports the checked code never calls, or stand-ins named here): logging, transformers,
peft, PIL, modelscope, accelerate and swift's own helpers; `to_device` is the identity and
`get_current_device` 'cpu' (the batch stays where it is); megatron's parallel_state is
`ParallelStateStandIn` (one process plays every rank); megatron-core's
`_undo_attention_load_balancing` runs as installed, with TransformerEngine's
`thd_get_partitioned_indices` (a CUDA kernel) played by `_TEPartitionStandIn`, transcribed from
TE's `thd_partition_indices_kernel`.

Reproducers (torch and the wheels; megatron imports answered by placeholders, except for the
inverses that call megatron-core's undo, which need megatron-core): the batch path's fetches
the mcore-bridge wheel too ($MCORE_BRIDGE_WHEEL, else pip download).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    ContractChecked,
    Finding,
    Library,
    function_line,
    reproducer_source,
)
from recipe.parallel.cp.contract import Impact, global_batch
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

SWIFT = "ms-swift"
BRIDGE = "mcore-bridge"
BRIDGE_FILE = "mcore_bridge/utils/megatron_utils.py"
COLLATOR_FILE = "swift/template/base.py"
PARAMS_FILE = "swift/utils/transformers_utils.py"
UTILS_FILE = "swift/megatron/utils/utils.py"
SPLIT_FILE = "swift/megatron/utils/megatron_lm_utils.py"
TRAINER_FILE = "swift/megatron/trainers/utils.py"

# The mcore-bridge release each ms-swift release runs on here (the newest its requirement allows
# whose split runs on a CPU tensor).
BRIDGE_FOR_SWIFT = {"4.6.0": "1.6.5"}
PAD_ID = 0
IGNORE = -100

_log = logging.getLogger(__name__)


def _get_logger(*args, **kwargs):
    return _log


# ---------------------------------------------------------------- stand-ins for the dependencies


class _TEPartitionStandIn:
    """TransformerEngine's `thd_get_partitioned_indices` (a CUDA kernel), transcribed from
    `thd_partition_indices_kernel` (transformer_engine/common/fused_attn/context_parallel.cu):
    for each of rank's total/world slots, the global index of the token it holds, each sequence
    of `cu_seqlens` split in 2*world chunks of which the rank holds chunk rank and 2*world-1-rank.
    The kernel asserts every boundary is a multiple of 2*world."""

    @staticmethod
    def thd_get_partitioned_indices(cu_seqlens, total_tokens: int, world_size: int, rank: int):
        cu = torch.as_tensor(cu_seqlens).to(torch.int64).cpu()
        if bool((cu % (world_size * 2)).any()):
            raise AssertionError(
                f"thd_get_partitioned_indices: cu_seqlens {cu.tolist()} not a multiple of "
                f"2*world_size={2 * world_size} (the kernel's assert)"
            )
        cu_s = cu // world_size
        token = torch.arange(int(total_tokens) // world_size)
        # the kernel's binary_search(token, cu_s, batch + 1): the last i with cu_s[i] <= token,
        # searched in [0, batch - 1]
        seq = torch.searchsorted(cu_s[1:-1], token, right=True)
        seq_len = cu_s[seq + 1] - cu_s[seq]
        index = token - cu_s[seq]
        offset = torch.where(index < seq_len // 2, rank, (world_size - 1) * 2 - rank)
        return index + cu_s[seq] * world_size + seq_len // 2 * offset


def _with_te_stand_in(function: Callable) -> Callable:
    """megatron-core's function with TE's kernel played by _TEPartitionStandIn (a copy: the
    installed megatron-core is left as it is)."""
    namespace = dict(function.__globals__)
    namespace["tex"] = _TEPartitionStandIn
    namespace["is_te_min_version"] = lambda *args, **kwargs: True
    return types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )


class _UnknownOption(Exception):
    """The released code read an option (an attribute of args or of the template) that this
    adapter does not know; the check refuses (UpstreamUnavailable) rather than guess it."""


class _Strict:
    """An object with these attributes only: reading any other records it and fails, so that a
    release that reads a new option (also through getattr with a default) is refused."""

    def __init__(self, values: dict, unknown: list, what: str):
        vars(self).update(values)
        object.__setattr__(self, "_unknown", unknown)
        object.__setattr__(self, "_what", what)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._unknown.append(f"{self._what}.{name}")
        raise _UnknownOption(f"{self._what}.{name}")


@contextlib.contextmanager
def _npu_off():
    """trainers/utils.py:359 imports transformers.utils at call time to ask whether an NPU is
    there: it is not (the NPU branch is an Ascend path)."""
    saved = sys.modules.get("transformers.utils")
    sys.modules["transformers.utils"] = types.SimpleNamespace(is_torch_npu_available=lambda: False)
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("transformers.utils", None)
        else:
            sys.modules["transformers.utils"] = saved


@contextlib.contextmanager
def _swapped(namespace: dict, **values):
    saved = {k: namespace.get(k) for k in values}
    namespace.update(values)
    try:
        yield
    finally:
        namespace.update(saved)


# ---------------------------------------------------------------------------- loading releases

_NOT_CALLED = {}  # a stub whose attributes the checked code never calls

BRIDGE_STUBS = {
    "transformers": _NOT_CALLED,  # set_seed: set_random_seed only
    "mcore_bridge.utils.logger": {"get_logger": _get_logger},
}


def _swift_stubs(released: dict) -> dict[str, dict]:
    """The imports of each ms-swift file, `released` (name -> the released function) wiring one
    file to the others as the package would."""
    npu = {"is_torch_npu_available": lambda: False}
    packages = {"swift": {}, "swift.megatron": {}, "swift.megatron.utils": {}}
    return {
        PARAMS_FILE: {
            "transformers": _NOT_CALLED,
            "transformers.integrations": _NOT_CALLED,  # is_deepspeed_zero3_enabled
            "transformers.trainer_utils": _NOT_CALLED,  # set_seed
            "swift.utils.logger": {"get_logger": _get_logger},
            "swift.utils.utils": _NOT_CALLED,  # deep_getattr
        },
        UTILS_FILE: {
            "transformers": _NOT_CALLED,
            "transformers.utils": npu,
            "swift": {},
            "swift.tuners": _NOT_CALLED,  # LoraConfig, Swift: adapter set-up
            "swift.utils": {
                "get_logger": _get_logger,
                "get_packed_seq_params": released.get("params"),
            },
        },
        SPLIT_FILE: {
            **packages,
            "mcore_bridge": {"split_cp_inputs": released.get("split_cp_inputs")},
            "transformers": _NOT_CALLED,
            "transformers.utils": npu,
            "swift.utils": {"get_logger": _get_logger},
            "swift.megatron.utils.megatron_fsdp_checkpoint": _NOT_CALLED,
            "swift.megatron.utils.patcher": _NOT_CALLED,
        },
        TRAINER_FILE: {
            **packages,
            "accelerate": _NOT_CALLED,
            "accelerate.utils": _NOT_CALLED,  # gather, gather_object
            "swift.dataloader": _NOT_CALLED,
            "swift.megatron.utils": {
                "get_batch_on_this_cp_rank": released.get("get_batch_on_this_cp_rank"),
                "get_packed_seq_params": released.get("get_packed_seq_params"),
            },
            "swift.utils": {
                "get_logger": _get_logger,
                "to_device": lambda data, *args, **kwargs: data,
                "get_current_device": lambda: "cpu",
            },
        },
        COLLATOR_FILE: {
            "modelscope": {},
            "modelscope.hub": {},
            "modelscope.hub.utils": {},
            "modelscope.hub.utils.utils": _NOT_CALLED,
            "peft": _NOT_CALLED,
            # annotations evaluated when the class is defined
            "PIL": {"Image": types.SimpleNamespace(Image=object)},
            "transformers": _NOT_CALLED,
            "transformers.integrations": _NOT_CALLED,
            "transformers.utils": _NOT_CALLED,
            "swift": {},
            # retry_decorator wraps `encode` when the class is defined; the collator never calls it
            "swift.utils": {
                "get_logger": _get_logger,
                "retry_decorator": lambda *args, **kwargs: lambda function: function,
            },
            "swift.template": {},
            "swift.template.template_inputs": _NOT_CALLED,
            "swift.template.utils": _NOT_CALLED,
            "swift.template.vision_utils": _NOT_CALLED,
        },
    }


def _tag(version: str) -> str:
    return re.sub(r"\W", "_", version)


def _function(module, name: str, label: str, file: str) -> Callable:
    function = getattr(module, name, None)
    if not callable(function):
        raise UpstreamUnavailable(f"{label} has no {name} in {file}")
    return function


@functools.cache
def _bridge(version: str | None) -> tuple[types.ModuleType, str]:
    """mcore-bridge's megatron_utils.py from this release, its megatron-core undo with TE's
    kernel played (see _with_te_stand_in)."""
    path, version = source_file(BRIDGE, version, BRIDGE_FILE)
    # a name inside mcore_bridge.utils, so the file's `from .logger import` finds the stub
    module = load_module(path, f"mcore_bridge.utils.recipe_megatron_utils_{_tag(version)}",
                         BRIDGE_STUBS)  # fmt: skip
    for name in ("split_cp_inputs", "reconstruct_tensor_cp"):
        _function(module, name, f"{BRIDGE}@{version}", BRIDGE_FILE)
    undo = getattr(module, "_undo_attention_load_balancing", None)
    if undo is not None:
        module._undo_attention_load_balancing = _with_te_stand_in(undo)
    return module, version


@dataclass
class _Swift:
    """One ms-swift release's files on one mcore-bridge release."""

    version: str
    bridge: types.ModuleType
    bridge_version: str
    collator: types.ModuleType
    utils: types.ModuleType
    split: types.ModuleType
    trainer: types.ModuleType


def _bridge_version_for(version: str | None) -> str | None:
    """The mcore-bridge release to run ms-swift `version` on (None: the installed ones)."""
    if version is None:
        return None
    bridge = BRIDGE_FOR_SWIFT.get(version)
    if bridge is None:
        raise UpstreamUnavailable(
            f"{SWIFT}@{version}: which mcore-bridge release it runs on is not known here; add it "
            "to BRIDGE_FOR_SWIFT in recipe/checks/upstream/libraries/ms_swift.py (the newest its "
            "requirement "
            f"allows whose split runs on CPU tensors: 1.6.5 or later)"
        )
    metadata, _ = source_file(SWIFT, version, f"ms_swift-{version}.dist-info/METADATA")
    from packaging.requirements import Requirement

    for line in metadata.read_text().splitlines():
        if re.match(r"Requires-Dist:\s*mcore[-_]bridge\b", line):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if not requirement.specifier.contains(bridge, prereleases=True):
                raise UpstreamUnavailable(
                    f"{SWIFT}@{version} requires {requirement}, which excludes mcore-bridge "
                    ""
                    f"{bridge}; update BRIDGE_FOR_SWIFT in "
                    "recipe/checks/upstream/libraries/ms_swift.py"
                )
            return bridge
    raise UpstreamUnavailable(f"{SWIFT}@{version} does not require mcore-bridge (METADATA)")


@functools.cache
def _swift(version: str | None) -> _Swift:
    bridge, bridge_version = _bridge(_bridge_version_for(version))
    released: dict = {"split_cp_inputs": bridge.split_cp_inputs}

    def load(file: str, name: str):
        path, found = source_file(SWIFT, version, file)
        package = {
            PARAMS_FILE: "swift.utils",
            UTILS_FILE: "swift.megatron.utils",
            SPLIT_FILE: "swift.megatron.utils",
            TRAINER_FILE: "swift.megatron.trainers",
            COLLATOR_FILE: "swift.template",
        }[file]
        stubs = _swift_stubs(released)[file]
        return load_module(path, f"{package}.recipe_{name}_{_tag(found)}", stubs), found

    params, version = load(PARAMS_FILE, "transformers_utils")
    label = f"{SWIFT}@{version}"
    released["params"] = _function(params, "get_packed_seq_params", label, PARAMS_FILE)
    utils, _ = load(UTILS_FILE, "utils")
    split, _ = load(SPLIT_FILE, "megatron_lm_utils")
    for name, module, file in (
        ("get_packed_seq_params", utils, UTILS_FILE),
        ("get_padding_to", utils, UTILS_FILE),
        ("reconstruct_tensor_cp", utils, UTILS_FILE),
        ("get_batch_on_this_cp_rank", split, SPLIT_FILE),
    ):
        released[name] = _function(module, name, label, file)
    trainer, _ = load(TRAINER_FILE, "trainer_utils")
    collator, _ = load(COLLATOR_FILE, "base")
    for name, module, file in (
        ("prepare_batch", trainer, TRAINER_FILE),
        ("reconstruct_tensor_cp", trainer, TRAINER_FILE),
        ("Template", collator, COLLATOR_FILE),
    ):
        _function(module, name, label, file)
    undo = getattr(utils, "_undo_attention_load_balancing", None)
    if undo is not None:
        utils._undo_attention_load_balancing = _with_te_stand_in(undo)
    return _Swift(version, bridge, bridge_version or "installed", collator, utils, split, trainer)


# --------------------------------------------------------------------- the options of the path

# ms-swift's defaults (swift/megatron/arguments/megatron_args.py, template_args.py)
PATH_DEFAULTS = {
    "padding_free": True,  # megatron_args.py:545
    "padding_side": "right",  # template_args.py:137
    "sequence_parallel": False,  # megatron_args.py:628
    "fp8_format": None,  # megatron_args.py:662
    "fp8_recipe": "delayed",  # megatron_args.py:663
    "fp4_format": None,  # megatron_args.py:669
    "attention_backend": "flash",  # megatron_args.py:519
}
PATH_DRAWN = {
    "padding_free": (True, False),
    "padding_side": ("right", "left"),
    "sequence_parallel": (False, True),
    "fp8_format": (None, "e4m3", "hybrid"),
    "fp8_recipe": ("delayed", "tensorwise", "blockwise", "mxfp8"),
    "fp4_format": (None, "e2m1"),
    "attention_backend": ("flash", "fused", "unfused", "local", "auto"),
}
BATCH_DEFAULTS = {
    **PATH_DEFAULTS,
    "is_multimodal": False,
    "cp_partition_mode": "zigzag",  # megatron_args.py:631
    "loss_scale": False,  # a binary loss scale (the default) encodes none (base.py:1237)
}
BATCH_DRAWN = {
    **PATH_DRAWN,
    "is_multimodal": (False, True),
    "cp_partition_mode": ("zigzag", "contiguous"),
    "loss_scale": (False, True),
}
PATH_FIXED = {
    "task_type": "causal_lm: the other task types carry one label per sample, which "
    "get_batch_on_this_cp_rank leaves whole (megatron_lm_utils.py:884-885)",
    "is_torch_npu_available": "False: the NPU branches (utils.py:277, megatron_lm_utils.py:889, "
    "trainers/utils.py:359) are an Ascend path",
    "pipeline_model_parallel_size": "1: earlier stages drop the labels, they compute no loss "
    "(trainers/utils.py:26-32)",
    "mode": "train: the collator pads on the left outside training (base.py:2070)",
    "position_ids": "1-D (text models; mrope's 3-D ones go through the same lines)",
    "pad_token_id": "0, never a real token id here",
}
# padding_side=left without padding_free: the collator refuses it (base.py:2078), not a finding
REFUSED_LEFT_PADDING = 'padding_side must be "right"'


def _settings(defaults: dict, options: dict) -> dict:
    unknown = set(options) - set(defaults)
    if unknown:
        raise UpstreamUnavailable(f"unknown options {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **options}


def _sequences(lengths) -> list[list[int]]:
    """Token ids unique over the micro-batch (0 is padding)."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


def _encoded(sequences, loss_scale: bool) -> list[dict]:
    """What `Template.encode` gives the collator for a training sample (base.py:1646-1652,
    :1605): labels are the tokens with the first one -100, loss_scale (when the template keeps
    one) 0 there and 1 on the rest."""
    out = []
    for tokens in sequences:
        sample = {"input_ids": list(tokens), "labels": [IGNORE, *tokens[1:]], "length": len(tokens)}
        if loss_scale:
            sample["loss_scale"] = [0.0] + [1.0] * (len(tokens) - 1)
        out.append(sample)
    return out


@dataclass
class _Batch:
    """One rank's batch after ms-swift's path, and the row it was split from."""

    batch: dict
    rows: int  # samples side by side without padding_free, else 1
    width: int  # the row's length before the split
    cu_seqlens: torch.Tensor | None  # packed_seq_params.cu_seqlens_q (None without padding_free)


def _run_path(swift: _Swift, cp_split: Callable, sequences, cp: int, rank: int, tp: int,
              s: dict, unknown: list) -> _Batch:  # fmt: skip
    """ms-swift's collator and prepare_batch on one rank, `cp_split` as its
    get_batch_on_this_cp_rank."""
    args = _Strict(
        {
            "tensor_model_parallel_size": tp,
            "context_parallel_size": cp,
            "pipeline_model_parallel_size": 1,
            "sequence_parallel": s["sequence_parallel"],
            "fp8_format": s["fp8_format"],
            "fp8": s["fp8_format"],  # megatron_args.py:890
            "fp4_format": s["fp4_format"],
            "fp4": s["fp4_format"],  # megatron_args.py:891
            "fp8_recipe": s["fp8_recipe"],
            "attention_backend": s["attention_backend"],
            "task_type": "causal_lm",
            "padding_free": s["padding_free"],
            "is_multimodal": s.get("is_multimodal", False),
            "cp_partition_mode": s.get("cp_partition_mode", "zigzag"),
        },
        unknown,
        "args",
    )
    template = _template(swift, s, cp, unknown)
    padding_to = swift.utils.get_padding_to(args)
    data = template._data_collator(_encoded(sequences, s.get("loss_scale", False)),
                                   padding_to=padding_to)  # fmt: skip
    rows, width = data["input_ids"].shape
    ranks = ParallelStateStandIn(cp, rank, tp)
    swift.bridge.mpu = ranks
    cp_split.__globals__["mpu"] = ranks
    swift.trainer.mpu = ranks
    with _npu_off(), _swapped(vars(swift.trainer), get_batch_on_this_cp_rank=cp_split):
        batch = swift.trainer.prepare_batch(args, data)
    params = batch.get("packed_seq_params")
    cu = None if params is None else params.cu_seqlens_q.to(torch.int64).cpu()
    return _Batch(batch, rows, width, cu)


def _template(swift: _Swift, s: dict, cp: int, unknown: list):
    """A Template with the attributes the collator reads; any other read is recorded."""
    base = swift.collator.Template

    class Strict(base):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            unknown.append(f"template.{name}")
            raise _UnknownOption(f"template.{name}")

    template = Strict.__new__(Strict)
    vars(template).update(
        tokenizer=types.SimpleNamespace(pad_token_id=PAD_ID),
        padding_side=s["padding_side"],
        mode="train",
        use_megatron=True,
        padding_free=s["padding_free"],
        sequence_parallel_size=cp,  # megatron_base_args.py:35
        packing=False,
        task_type="causal_lm",
    )
    return template


def _fields(got: _Batch, s: dict) -> dict[str, torch.Tensor]:
    """The rank's per-token tensors in the contract's terms, rows side by side."""
    batch = got.batch
    labels = batch["labels"].reshape(-1)
    weight = (labels != IGNORE).to(torch.float64)
    if batch.get("loss_scale") is not None:
        weight = weight * batch["loss_scale"].reshape(-1).to(torch.float64)
    out = {
        "position_ids": batch["position_ids"].reshape(-1),
        "labels": labels,
        "loss_mask": weight,
    }
    if not s.get("is_multimodal", False):
        out["input_ids"] = batch["input_ids"].reshape(-1)
    return out


def _layout(got: _Batch, n: int) -> torch.Tensor:
    """The samples' boundaries in the row(s): cu_seqlens_q up to the last sample (the tail's
    padding segments after it), or one sample per row."""
    if got.cu_seqlens is None:
        return torch.arange(n + 1, dtype=torch.int64) * got.width
    return got.cu_seqlens[: n + 1]


def _case(lengths, cp: int, tp: int) -> str:
    return f"lengths={list(lengths)} cp={cp} tp={tp}"


def _where(sequences) -> dict[int, tuple[int, int]]:
    return {t: (i, p) for i, seq in enumerate(sequences) for p, t in enumerate(seq)}


def _tail_problem(sequences, fields: list[dict], cu_end: int, cp: int) -> str | None:
    """Zigzag, packed: past the last sample's boundary a rank holds only the tail's padding
    segments, so no real token and no loss weight. Of the real tokens found there, one that
    trains at another position than its own is named first (the harm is plainest)."""
    where = _where(sequences)
    start = cu_end // cp
    found, weighted = [], None
    for rank, got in enumerate(fields):
        for slot in range(start, got["loss_mask"].numel()):
            if "input_ids" in got and int(got["input_ids"][slot]) in where:
                i, p = where[int(got["input_ids"][slot])]
                found.append((int(got["position_ids"][slot]) == p, rank, slot, i, p,
                              int(got["position_ids"][slot])))  # fmt: skip
            elif weighted is None and float(got["loss_mask"][slot]) != 0:
                weighted = (rank, slot, _number(float(got["loss_mask"][slot])))
    where_tail = f"(in the tail's padding segments, past the last sample's boundary {cu_end})"
    if found:
        _, rank, slot, i, p, at = min(found)
        return (
            f"rank {rank}, local slot {slot} {where_tail}: holds sequence {i} position {p}, "
            f"which trains there at position {at} of a padding segment"
        )
    if weighted is not None:
        rank, slot, weight = weighted
        return f"rank {rank}, local slot {slot} {where_tail}: loss weight {weight} on padding"
    return None


def _number(value: float):
    return int(value) if float(value).is_integer() else value


def _truth(sequences, cu: torch.Tensor, total: int) -> dict[str, list]:
    """Every global slot of a row (or rows side by side) of `total` slots laid out on `cu`: its
    sample and position (-1 past the last sample), token, next-token label and loss weight."""
    seq, pos = [-1] * total, [-1] * total
    token, label, weight = [PAD_ID] * total, [IGNORE] * total, [0] * total
    for i, tokens in enumerate(sequences):
        for g in range(int(cu[i]), int(cu[i + 1])):
            p = g - int(cu[i])
            seq[g], pos[g] = i, p
            if p < len(tokens):
                token[g] = tokens[p]
            if p + 1 < len(tokens):
                label[g], weight[g] = tokens[p + 1], 1
    return {"sequence": seq, "position": pos, "token": token, "label": label, "weight": weight}


def _contiguous_problem(sequences, fields: list[dict], cu: torch.Tensor, rows: int, width: int,
                        cp: int) -> tuple[Impact, str] | None:  # fmt: skip
    """Contiguous CP: of each row of `width` slots rank r holds slots [r*width/cp,
    (r+1)*width/cp); every real token there with its position, label and weight, padding
    weighted 0, and every real token on a rank."""
    where = _where(sequences)
    if "input_ids" in fields[0]:
        seen = {int(t) for got in fields for t in got["input_ids"].tolist()}
        missing = [where[t] for t in where if t not in seen]
        if missing:
            listed = ", ".join(f"sequence {i} position {p}" for i, p in missing[:6])
            return Impact.LOST, f"{len(missing)} real tokens are on no rank ({listed})"
    truth = _truth(sequences, cu, rows * width)
    local = width // cp
    for rank, got in enumerate(fields):
        for name, value in got.items():
            if value.numel() != rows * local:
                return Impact.MISPLACED, (
                    f"rank {rank}: {name} holds {value.numel()} slots, contiguous CP gives each "
                    f"rank {rows} x {local}"
                )
        for slot in range(rows * local):
            g = (slot // local) * width + rank * local + slot % local
            i, p = truth["sequence"][g], truth["position"][g]
            real = i >= 0 and p < len(sequences[i])
            expected = {"loss_mask": truth["weight"][g]}
            if real:
                expected.update(input_ids=truth["token"][g], position_ids=p)
            if truth["weight"][g]:
                expected["labels"] = truth["label"][g]
            for name, want in expected.items():
                if name in got and float(got[name][slot]) != want:
                    at = f"sequence {i}, position {p}" if real else "padding"
                    return Impact.MISPLACED, (
                        f"rank {rank}, local slot {slot} (global slot {g}: {at}): {name} "
                        f"expected {want}, got {_number(float(got[name][slot]))}"
                    )
    return None


# ------------------------------------------------------------------------------- the targets


@dataclass
class _Target(CheckTarget):
    name: str
    file: str
    kind: type

    def load(self, library: str, distribution: str, version: str | None):
        return self.kind.build(library, distribution, version, self)


class _BatchChecked(ContractChecked):
    """ms-swift's get_batch_on_this_cp_rank on the batch its collator and prepare_batch give
    it: every field one rank trains on, against the zigzag contract (or contiguous CP)."""

    swift: _Swift
    cp_split: Callable
    unknown: list

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: _Target):
        swift = _swift(version)
        checked = cls(library, swift.version, target.name, distribution, target.file,
                      dict(BATCH_DRAWN), dict(PATH_FIXED))  # fmt: skip
        checked.notes = (
            f"runs on {BRIDGE} {swift.bridge_version} (split_cp_inputs, {BRIDGE_FILE}:"
            f"{function_line(swift.bridge, 'split_cp_inputs')}), after ms-swift's collator "
            f"({COLLATOR_FILE}) and prepare_batch ({TRAINER_FILE})",
        )
        checked.swift, checked.unknown = swift, []
        checked.cp_split = swift.split.get_batch_on_this_cp_rank
        checked._probe()
        return checked

    @property
    def line(self) -> int:
        return function_line(self.swift.split, "get_batch_on_this_cp_rank")

    def _probe(self) -> None:
        """Each drawn value once, so a release reading an option not known here is refused at
        load, not in the middle of a search."""
        for name, values in self.drawn.items():
            for value in values:
                with contextlib.suppress(Exception):
                    self._ranks([3, 5], 2, 2, {**BATCH_DEFAULTS, name: value})
        self._refuse_unknown()

    def _refuse_unknown(self) -> None:
        if self.unknown:
            names = ", ".join(sorted(set(self.unknown)))
            self.unknown.clear()
            raise UpstreamUnavailable(
                f"{self.label} reads {names}, an option the adapter does not know; it may change "
                "the layout, so the check stops: teach "
                "recipe/checks/upstream/libraries/ms_swift.py what it does"
            )

    def _ranks(self, lengths, cp: int, tp: int, s: dict, sequences=None) -> list[_Batch]:
        sequences = sequences or _sequences(lengths)
        return [_run_path(self.swift, self.cp_split, sequences, cp, rank, tp, s, self.unknown)
                for rank in range(cp)]  # fmt: skip

    def sequence_parallel(self, options: dict) -> bool:
        return bool(_settings(BATCH_DEFAULTS, options)["sequence_parallel"])

    def contract_function(self, options: dict) -> Callable:
        s = _settings(BATCH_DEFAULTS, options)

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            tokens = [seq.tolist() for seq in sequences]
            got = _run_path(self.swift, self.cp_split, tokens, cp_size, cp_rank, tp_size, s,
                            self.unknown)  # fmt: skip
            cu = _layout(got, len(tokens))
            fields = _fields(got, s)
            end = int(cu[-1]) // cp_size
            out = {k: (v[:end] if v.numel() >= end else v) for k, v in fields.items()}
            return {**out, "cu_seqlens_padded": cu}

        return per_rank

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp, tp = case
        s = _settings(BATCH_DEFAULTS, options)
        described = _case(lengths, cp, tp)
        self.unknown.clear()
        sequences = _sequences(lengths)
        try:
            batches = self._ranks(lengths, cp, tp, s, sequences)
        except AssertionError as err:
            if REFUSED_LEFT_PADDING in str(err):
                return None
            return self._finding(case, options, Impact.RAISES, f"{described}: raises "
                                 f"AssertionError: {err}")  # fmt: skip
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            self._refuse_unknown()
            return self._finding(case, options, Impact.RAISES,
                                 f"{described}: raises {type(err).__name__}: {err}")  # fmt: skip
        fields = [_fields(b, s) for b in batches]
        cu = _layout(batches[0], len(lengths))
        if s["cp_partition_mode"] == "contiguous":
            found = _contiguous_problem(sequences, fields, cu, batches[0].rows,
                                        batches[0].width, cp)  # fmt: skip
            if found is None:
                return None
            return self._finding(case, options, found[0], f"{described}: {found[1]}")
        if batches[0].cu_seqlens is not None:
            tail = _tail_problem(sequences, fields, int(cu[-1]), cp)
            if tail is not None:
                return self._finding(case, options, Impact.MISPLACED, f"{described}: {tail}")
        found = super().finding(case, options)
        self._refuse_unknown()
        return found

    def _finding(self, case, options, impact: Impact, what: str) -> Finding:
        lengths, cp, tp = case
        return Finding({"lengths": list(lengths), "cp": cp, "tp": tp},
                       tuple(sorted(options.items())), impact, what)  # fmt: skip

    def broken_copy(self, part: str = "function") -> _BatchChecked:
        """get_batch_on_this_cp_rank reading the packed params' boundaries under a wrong name
        (`cu_seqlens`, which PackedSeqParams does not have): each rank's zigzag chunks are then
        taken over the whole row, not per sample."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = copy.copy(self)
        broken.unknown = []
        broken.cp_split = layouts.mutated_function(
            self.cp_split,
            "getattr(packed_seq_params, 'cu_seqlens_q', None), -1",
            "getattr(packed_seq_params, 'cu_seqlens', None), -1",
            self.label,
        )
        return broken

    def reproducer(self, finding: Finding) -> str | None:
        return reproducer_source(
            f"{self.label} ({self.file}:{self.line}) on {BRIDGE} {self.swift.bridge_version}: "
            "what one CP rank trains on after ms-swift's collator and prepare_batch",
            finding,
            f"DEFAULTS = {BATCH_DEFAULTS!r}\n"
            + _BATCH_REPRODUCER.replace("BRIDGE_PIN", repr(self.swift.bridge_version)),
            self.distribution,
            self.version,
        )

    def truth_outputs(self, finding: Finding):
        """Per rank, what each slot should hold: the contract's zigzag (or contiguous) slots of
        the row the release laid out, its own boundaries kept."""
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = _settings(BATCH_DEFAULTS, dict(finding.options))
        sequences = _sequences(lengths)
        got = _run_path(self.swift, self.swift.split.get_batch_on_this_cp_rank, sequences, cp, 0,
                        tp, s, [])  # fmt: skip
        return _truth_outputs(sequences, _layout(got, len(lengths)), got.rows, got.width, cp,
                              s["cp_partition_mode"], not s["is_multimodal"])  # fmt: skip


# mcore-bridge's split alone, the tensor's layout drawn (ms-swift passes [1, T] along -1)
SPLIT_DEFAULTS = {"cp_partition_mode": "zigzag", "dim": "bs:-1", "cu_seqlens": "packed"}
SPLIT_DRAWN = {
    "cp_partition_mode": ("zigzag", "contiguous"),
    "dim": ("bs:-1", "bs:1", "bsh:1", "sbh:0"),
    "cu_seqlens": ("packed", "rows"),
}
SPLIT_FIXED = {
    "cu_seqlens values": "the contract's padded boundaries (every sample padded to 2*cp*tp), as "
    "ms-swift's position ids give cu_seqlens_q; `rows` passes None with one sample per row",
}
LAYOUTS = ("bs:-1", "bs:1", "bsh:1", "sbh:0")


def _shaped(rows: torch.Tensor, layout: str) -> tuple[torch.Tensor, int]:
    """[b, s] values as the tensor of `layout` ([b, s], [b, s, h] or [s, b, h]) and its dim."""
    shape, dim = layout.split(":")
    if shape == "bs":
        return rows, int(dim)
    stacked = torch.stack([rows * 2, rows * 2 + 1], dim=-1)  # h = 2 distinct values per slot
    return (stacked if shape == "bsh" else stacked.transpose(0, 1).contiguous()), int(dim)


def _unshaped(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of _shaped: [b, s] from the tensor's first hidden value."""
    shape = layout.split(":")[0]
    if shape == "bs":
        return tensor
    if shape == "sbh":
        tensor = tensor.transpose(0, 1)
    return torch.div(tensor[..., 0], 2, rounding_mode="floor")


def _stream_rows(sequences, cu: torch.Tensor, rows: bool) -> tuple[dict, torch.Tensor, int]:
    """The contract's fields on the packed row (or one row per sample, each padded to the
    widest), the samples' boundaries, and the row width."""
    if rows:
        width = int(cu.diff().max())
        layout = torch.arange(len(sequences) + 1, dtype=torch.int64) * width
    else:
        width, layout = int(cu[-1]), cu.to(torch.int64)
    truth = _truth(sequences, layout, int(layout[-1]))
    fields = {
        "input_ids": torch.tensor(truth["token"]),
        "position_ids": torch.tensor([max(p, 0) for p in truth["position"]]),
        "labels": torch.tensor(truth["label"]),
        "loss_mask": torch.tensor(truth["weight"]),
    }
    n_rows = len(sequences) if rows else 1
    return {k: v.reshape(n_rows, width) for k, v in fields.items()}, layout, width


class _SplitChecked(ContractChecked):
    """mcore-bridge's split_cp_inputs on the contract's packed fields (ms-swift gives it labels
    already rolled, so the labels here are the next tokens)."""

    module: types.ModuleType
    split: Callable

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: _Target):
        module, version = _bridge(version)
        checked = cls(library, version, target.name, distribution, target.file,
                      dict(SPLIT_DRAWN), dict(SPLIT_FIXED))  # fmt: skip
        checked.module, checked.split = module, module.split_cp_inputs
        params = list(inspect.signature(checked.split).parameters)
        if params != ["inputs", "cu_seqlens", "dim", "cp_partition_mode"]:
            raise UpstreamUnavailable(
                f"{checked.label} split_cp_inputs takes {params}; the adapter knows (inputs, "
                "cu_seqlens, dim, cp_partition_mode): teach "
                "recipe/checks/upstream/libraries/ms_swift.py the rest"
            )
        return checked

    @property
    def line(self) -> int:
        return function_line(self.module, "split_cp_inputs")

    def _split_rank(self, sequences, cu, cp: int, rank: int, tp: int, s: dict):
        """(this rank's fields as [b, s/cp] rows flattened, the boundaries, rows, width)."""
        rows = s["cu_seqlens"] == "rows"
        fields, layout, width = _stream_rows(sequences, cu, rows)
        self.split.__globals__["mpu"] = ParallelStateStandIn(cp, rank, tp)
        kwargs = {} if s["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
        out = {}
        for name, value in fields.items():
            tensor, dim = _shaped(value, s["dim"])
            got = self.split(tensor, None if rows else cu.to(torch.int32), dim, **kwargs)
            out[name] = _unshaped(got, s["dim"]).reshape(-1)
        return out, layout, (len(sequences) if rows else 1), width

    def contract_function(self, options: dict) -> Callable:
        s = _settings(SPLIT_DEFAULTS, options)

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            tokens = [seq.tolist() for seq in sequences]
            out, layout, _, _ = self._split_rank(tokens, cu_seqlens_padded, cp_size, cp_rank,
                                                 tp_size, s)  # fmt: skip
            return {**out, "cu_seqlens_padded": layout}

        return per_rank

    def finding(self, case, options: dict) -> Finding | None:
        s = _settings(SPLIT_DEFAULTS, options)
        if s["cp_partition_mode"] == "zigzag":
            return super().finding(case, options)
        lengths, cp, tp = case
        sequences = _sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded
        described = _case(lengths, cp, tp)
        record = {"lengths": list(lengths), "cp": cp, "tp": tp}
        try:
            ranks = [self._split_rank(sequences, cu, cp, r, tp, s) for r in range(cp)]
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            return Finding(record, tuple(sorted(options.items())), Impact.RAISES,
                           f"{described}: raises {type(err).__name__}: {err}")  # fmt: skip
        _, layout, rows, width = ranks[0]
        found = _contiguous_problem(sequences, [r[0] for r in ranks], layout, rows, width, cp)
        if found is None:
            return None
        return Finding(record, tuple(sorted(options.items())), found[0], f"{described}: {found[1]}")

    def broken_copy(self, part: str = "function") -> _SplitChecked:
        """The mirror chunk one early: rank r takes chunks r and 2*cp-2-r."""
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = copy.copy(self)
        broken.split = layouts.mutated_function(self.split, "(2 * cp_size - cp_rank - 1)",
                                "(2 * cp_size - cp_rank - 2)", self.label)  # fmt: skip
        return broken

    def reproducer(self, finding: Finding) -> str | None:
        return reproducer_source(
            f"{self.label} ({self.file}:{self.line}): one CP rank's split of a packed micro-batch",
            finding,
            f"DEFAULTS = {SPLIT_DEFAULTS!r}\n" + _SPLIT_REPRODUCER,
            self.distribution,
            self.version,
        )

    def truth_outputs(self, finding: Finding):
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = _settings(SPLIT_DEFAULTS, dict(finding.options))
        sequences = _sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded
        rows = s["cu_seqlens"] == "rows"
        _, layout, width = _stream_rows(sequences, cu, rows)
        return _truth_outputs(sequences, layout, len(sequences) if rows else 1, width, cp,
                              s["cp_partition_mode"], True)  # fmt: skip


def _zigzag(start: int, end: int, cp: int, rank: int) -> torch.Tensor:
    chunk = (end - start) // (2 * cp)
    front = torch.arange(start + rank * chunk, start + (rank + 1) * chunk)
    back_start = start + (2 * cp - 1 - rank) * chunk
    return torch.cat([front, torch.arange(back_start, back_start + chunk)])


# ----------------------------------------------------------------- the inverses: round trips

RECON_DEFAULTS = {**PATH_DEFAULTS, "cp_partition_mode": "zigzag", "dim": "bsh:1"}
RECON_DRAWN = {**PATH_DRAWN, "cp_partition_mode": ("zigzag", "contiguous"), "dim": LAYOUTS}
TRAINER_RECON_DEFAULTS = {**PATH_DEFAULTS, "cp_partition_mode": "zigzag"}
TRAINER_RECON_DRAWN = {**PATH_DRAWN, "cp_partition_mode": ("zigzag", "contiguous")}
BRIDGE_RECON_DEFAULTS = {"cp_partition_mode": "zigzag", "dim": "bsh:1", "packed_seq_params": "thd"}
BRIDGE_RECON_DRAWN = {
    "cp_partition_mode": ("zigzag", "contiguous"),
    "dim": LAYOUTS,
    "packed_seq_params": ("thd", "rows"),
}
ROUND_TRIP_FIXED = {
    "shards": "each rank's split by mcore-bridge's split_cp_inputs with the batch's cu_seqlens_q "
    "(None without padding_free), as get_batch_on_this_cp_rank splits the inputs the model's "
    "per-token output follows",
    "all_gather": "played by a stand-in handing back every rank's shard",
}
TRAINER_FIXED = {
    **ROUND_TRIP_FIXED,
    "tensor": "[b, s] per-token logps along 1, as its callers pass them (trainers/utils.py:467, "
    "grpo_trainer.py:906, rlhf_mixin.py:81)",
    "num_samples": "the real sample count its callers pass (seq_lens; the micro-batch size "
    "without padding_free)",
}
BRIDGE_RECON_FIXED = {
    **ROUND_TRIP_FIXED,
    "cu_seqlens_q_padded": "None (ms-swift sets it only on NPU, to the same boundaries)",
}


@dataclass
class _Row:
    """The row(s) a round trip shards: their boundaries and what is real."""

    sequences: list
    cu: torch.Tensor | None  # the split's and the params' cu_seqlens (None: rows)
    params: object  # packed_seq_params as the callers hold it, or None
    layout: torch.Tensor  # the samples' boundaries in the row(s) laid side by side
    rows: int
    width: int

    def values(self) -> torch.Tensor:
        """[rows, width] float64, a distinct value per slot: 1 + its global slot."""
        return torch.arange(1, self.rows * self.width + 1, dtype=torch.float64).reshape(
            self.rows, self.width
        )

    def describe(self, g: int) -> str:
        """Global slot g (of the rows side by side) as sample and position, or padding."""
        for i, tokens in enumerate(self.sequences):
            if int(self.layout[i]) <= g < int(self.layout[i + 1]):
                p = g - int(self.layout[i])
                return f"sequence {i} position {p}" + ("" if p < len(tokens) else " (padding)")
        return "tail padding"

    def real(self) -> torch.Tensor:
        real = torch.zeros(self.rows * self.width, dtype=torch.bool)
        for i, tokens in enumerate(self.sequences):
            start = int(self.layout[i])
            real[start : start + len(tokens)] = True
        return real.reshape(self.rows, self.width)


def _round_trip_problem(row: _Row, expected: torch.Tensor, got: torch.Tensor, rank: int,
                        real: torch.Tensor) -> tuple[Impact, str] | None:  # fmt: skip
    """The result on one rank against the original: a real slot's value nowhere is lost, at
    another slot misplaced; only padding slots differing is padding."""
    values = expected[real]
    present = set(got.flatten().tolist())
    missing = [v for v in values.tolist() if v not in present]
    if missing:
        listed = ", ".join(row.describe(int(v) - 1) for v in missing[:4])
        return Impact.LOST, (
            f"rank {rank}: the values of {len(missing)} real tokens are in no slot of the result "
            f"({listed}{' ...' if len(missing) > 4 else ''}); result shape "
            f"{tuple(got.shape)}, original {tuple(expected.shape)}"
        )
    if got.shape != expected.shape:
        return Impact.MISPLACED, (
            f"rank {rank}: result shape {tuple(got.shape)}, the original {tuple(expected.shape)}"
        )
    wrong = got != expected
    if bool((wrong & real).any()):
        b, s = (int(x) for x in (wrong & real).nonzero()[0])
        g = b * row.width + s
        return Impact.MISPLACED, (
            f"rank {rank}: row {b} slot {s} ({row.describe(g)}) gets the value of "
            f"{row.describe(int(got[b, s]) - 1)}"
        )
    if bool(wrong.any()):
        b, s = (int(x) for x in wrong.nonzero()[0])
        return Impact.PADDING, (
            f"rank {rank}: row {b} slot {s} ({row.describe(b * row.width + s)}) gets "
            f"{_number(float(got[b, s]))}; every real token comes back to its slot"
        )
    return None


class _RoundTripChecked(Checked):
    """A split and its inverse: every rank shards a tensor of distinct values, every rank
    gathers it back through the inverse; each must get the original."""

    split: Callable  # mcore-bridge's split_cp_inputs
    inverse: Callable  # the checked function
    inverse_module: types.ModuleType
    inverse_name = "reconstruct_tensor_cp"
    defaults: dict
    mutation: tuple[str, str]

    @property
    def line(self) -> int:
        return function_line(self.inverse_module, "reconstruct_tensor_cp")

    def _row(self, lengths, cp: int, tp: int, s: dict) -> _Row:
        raise NotImplementedError

    def _call(self, shard: torch.Tensor, row: _Row, cp: int, s: dict) -> torch.Tensor:
        raise NotImplementedError

    def _expected(self, row: _Row) -> torch.Tensor:
        return row.values()

    def _layout_option(self, s: dict) -> str:
        return s.get("dim", "bs:1")

    def _shards(self, row: _Row, cp: int, tp: int, s: dict) -> list[torch.Tensor]:
        tensor, dim = _shaped(row.values(), self._layout_option(s))
        kwargs = {} if s["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
        shards = []
        for rank in range(cp):
            self.split.__globals__["mpu"] = ParallelStateStandIn(cp, rank, tp)
            shards.append(self.split(tensor, row.cu, dim, **kwargs))
        return shards

    def round_trip(self, row: _Row, cp: int, tp: int, s: dict) -> list[torch.Tensor]:
        """Each rank's result as [rows, slots], from its own shard and the others' gathered."""
        shards = self._shards(row, cp, tp, s)
        namespace = self.inverse.__globals__
        results = []
        with _swapped(namespace, torch=layouts.GatherStandIn(shards)):
            for rank in range(cp):
                namespace["mpu"] = ParallelStateStandIn(cp, rank, tp)
                results.append(_unshaped(self._call(shards[rank], row, cp, s),
                                         self._layout_option(s)))  # fmt: skip
        return results

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp, tp = case
        s = _settings(self.defaults, options)
        record = {"lengths": list(lengths), "cp": cp, "tp": tp}
        described = _case(lengths, cp, tp)
        try:
            row = self._row(lengths, cp, tp, s)
            results = self.round_trip(row, cp, tp, s)
        except _Refused:
            return None
        except _UnknownOption as err:
            raise UpstreamUnavailable(
                f"{self.label} reads {err}, an option the adapter does not know: teach "
                "recipe/checks/upstream/libraries/ms_swift.py what it does"
            ) from None
        except Exception as err:  # noqa: BLE001 (a raise on a valid input is the finding)
            return Finding(record, tuple(sorted(options.items())), Impact.RAISES,
                           f"{described}: raises {type(err).__name__}: {err}")  # fmt: skip
        expected = self._expected(row)
        real = row.real()[:, : expected.shape[1]]
        for rank, got in enumerate(results):
            found = _round_trip_problem(row, expected, got, rank, real)
            if found is not None:
                return Finding(record, tuple(sorted(options.items())), found[0],
                               f"{described}: {found[1]}")  # fmt: skip
        return None

    def broken_copy(self, part: str = "function") -> _RoundTripChecked:
        """The inverse with one deliberate bug (`mutation`); part "function" and "inverse" name
        the same function here, the inverse being the checked one."""
        if part not in ("function", "inverse"):
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        broken = copy.copy(self)
        broken.inverse = layouts.mutated_function(self.inverse, *self.mutation, self.label)
        return broken

    call: str  # how the reproducer calls the inverse: "utils", "trainer" or "bridge"
    package: str  # the package the inverse's file sits in

    def _spec(self, finding: Finding) -> tuple[_Row, dict]:
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = _settings(self.defaults, dict(finding.options))
        row = self._row(lengths, cp, tp, s)
        spec = {
            "relative": self.file,
            "package": self.package,
            "call": self.call,
            "cu": None if row.cu is None else [int(c) for c in row.cu],
            "rows": row.rows,
            "width": row.width,
            "layout": [int(c) for c in row.layout],
            "expected_width": int(self._expected(row).shape[1]),
            "dim": self._layout_option(s),
            "mode": s["cp_partition_mode"],
        }
        return row, spec

    def reproducer(self, finding: Finding) -> str | None:
        _, spec = self._spec(finding)
        return reproducer_source(
            f"{self.label} ({self.file}:{self.line}): a CP round trip, each rank gathering "
            "every rank's shard back",
            finding,
            f"SPEC = {spec!r}\n" + _ROUND_TRIP_REPRODUCER,
            self.distribution,
            self.version,
        )

    def truth_outputs(self, finding: Finding):
        row, _ = self._spec(finding)
        return {"ranks": [self._expected(row).tolist()] * finding.case["cp"]}


def _swift_row(checked, lengths, cp: int, tp: int, s: dict) -> _Row:
    """The packed row (or rows) ms-swift's collator and prepare_batch make of these samples."""
    sequences = _sequences(lengths)
    unknown: list = []
    try:
        got = _run_path(checked.swift, checked.swift.split.get_batch_on_this_cp_rank, sequences,
                        cp, 0, tp, {**s, "is_multimodal": False}, unknown)  # fmt: skip
    except AssertionError as err:
        if REFUSED_LEFT_PADDING in str(err):
            raise _Refused from None
        raise
    if unknown:
        raise _UnknownOption(", ".join(sorted(set(unknown))))
    params = got.batch.get("packed_seq_params")
    cu = None if params is None else params.cu_seqlens_q
    return _Row(sequences, cu, params, _layout(got, len(lengths)), got.rows, got.width)


class _Refused(Exception):
    """ms-swift refuses this configuration by design (not a finding)."""


class _SwiftReconstructChecked(_RoundTripChecked):
    """ms-swift's swift/megatron/utils/utils.py reconstruct_tensor_cp (trainers/base.py:1138)."""

    swift: _Swift
    defaults = RECON_DEFAULTS
    call, package = "utils", "swift.megatron.utils"
    mutation = (
        "out = _undo_attention_load_balancing(gathered, cp_size, packed_seq_params)",
        "out = _undo_attention_load_balancing(gathered, cp_size, None)",
    )

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: _Target):
        swift = _swift(version)
        checked = cls(library, swift.version, target.name, distribution, target.file,
                      dict(RECON_DRAWN), dict(ROUND_TRIP_FIXED))  # fmt: skip
        checked.swift, checked.split = swift, swift.bridge.split_cp_inputs
        checked.inverse_module, checked.inverse = swift.utils, swift.utils.reconstruct_tensor_cp
        _known_params(checked, ["tensor", "packed_seq_params", "dim", "cp_partition_mode"])
        return checked

    def _row(self, lengths, cp, tp, s):
        return _swift_row(self, lengths, cp, tp, s)

    def _call(self, shard, row, cp, s):
        return self.inverse(shard, row.params, dim=_shaped(row.values(), s["dim"])[1],
                            cp_partition_mode=s["cp_partition_mode"])  # fmt: skip


class _TrainerReconstructChecked(_RoundTripChecked):
    """ms-swift's swift/megatron/trainers/utils.py reconstruct_tensor_cp (per-token logps)."""

    swift: _Swift
    defaults = TRAINER_RECON_DEFAULTS
    call, package = "trainer", "swift.megatron.trainers"
    mutation = ("(chunks >= cp_size) * half_chunks", "(chunks > cp_size) * half_chunks")

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: _Target):
        swift = _swift(version)
        checked = cls(library, swift.version, target.name, distribution, target.file,
                      dict(TRAINER_RECON_DRAWN), dict(TRAINER_FIXED))  # fmt: skip
        checked.swift, checked.split = swift, swift.bridge.split_cp_inputs
        checked.inverse_module = swift.trainer
        checked.inverse = swift.trainer.reconstruct_tensor_cp
        _known_params(checked, ["cp_size", "tensor", "packed_seq_params", "num_samples",
                                "cp_partition_mode"])  # fmt: skip
        return checked

    def _row(self, lengths, cp, tp, s):
        return _swift_row(self, lengths, cp, tp, s)

    def _call(self, shard, row, cp, s):
        return self.inverse(cp, shard, row.params, len(row.sequences), s["cp_partition_mode"])

    def _expected(self, row: _Row) -> torch.Tensor:
        """The samples' slots: the callers want [1, cu_seqlens_q[num_samples]] of a packed row
        (the tail dropped), the whole [b, s] without padding_free."""
        values = row.values()
        return values if row.params is None else values[:, : int(row.layout[-1])]


class _BridgeReconstructChecked(_RoundTripChecked):
    """mcore-bridge's reconstruct_tensor_cp on the contract's packed layout."""

    module: types.ModuleType
    defaults = BRIDGE_RECON_DEFAULTS
    call, package = "bridge", "mcore_bridge.utils"
    mutation = _SwiftReconstructChecked.mutation

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: _Target):
        module, version = _bridge(version)
        checked = cls(library, version, target.name, distribution, target.file,
                      dict(BRIDGE_RECON_DRAWN), dict(BRIDGE_RECON_FIXED))  # fmt: skip
        checked.module, checked.split = module, module.split_cp_inputs
        checked.inverse_module, checked.inverse = module, module.reconstruct_tensor_cp
        _known_params(checked, ["tensor", "packed_seq_params", "dim", "cp_partition_mode"])
        return checked

    def _row(self, lengths, cp, tp, s):
        from megatron.core.packed_seq_params import PackedSeqParams

        sequences = _sequences(lengths)
        cu = global_batch(sequences, cp, tp).cu_seqlens_padded.to(torch.int32)
        if s["packed_seq_params"] == "rows":
            width = int(cu.diff().max())
            layout = torch.arange(len(lengths) + 1, dtype=torch.int64) * width
            return _Row(sequences, None, None, layout, len(lengths), width)
        longest = int(cu.diff().max())
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip
        return _Row(sequences, cu, params, cu.to(torch.int64), 1, int(cu[-1]))

    def _call(self, shard, row, cp, s):
        return self.inverse(shard, row.params, _shaped(row.values(), s["dim"])[1],
                            cp_partition_mode=s["cp_partition_mode"])  # fmt: skip


def _known_params(checked: Checked, known: list[str]) -> None:
    params = list(inspect.signature(checked.inverse).parameters)
    if params != known:
        raise UpstreamUnavailable(
            f"{checked.label} reconstruct_tensor_cp takes {params}; the adapter knows {known}: "
            "teach recipe/checks/upstream/libraries/ms_swift.py the rest"
        )


LIBRARY = Library(
    SWIFT,
    (
        _Target("get_batch_on_this_cp_rank", SPLIT_FILE, _BatchChecked),
        _Target("utils.reconstruct_tensor_cp", UTILS_FILE, _SwiftReconstructChecked),
        _Target("trainers.reconstruct_tensor_cp", TRAINER_FILE, _TrainerReconstructChecked),
    ),
    releases=("4.6.0",),
)
MCORE_BRIDGE = Library(
    BRIDGE,
    (
        _Target("split_cp_inputs", BRIDGE_FILE, _SplitChecked),
        _Target("reconstruct_tensor_cp", BRIDGE_FILE, _BridgeReconstructChecked),
    ),
    releases=("1.6.5",),
)
LIBRARIES = {SWIFT: LIBRARY, BRIDGE: MCORE_BRIDGE}


def _truth_outputs(sequences, layout: torch.Tensor, rows: int, width: int, cp: int, mode: str,
                   with_tokens: bool) -> dict:  # fmt: skip
    """What a correct split gives each rank, in the reproducers' structure: the ground truth's
    slots of the row(s) laid out on `layout` (the samples' boundaries the release chose),
    zigzag per sample with the tail's padding in segments of 2*cp, or contiguous blocks."""
    total = rows * width
    truth = _truth(sequences, layout, total)
    fields = {
        "input_ids": truth["token"],
        "position_ids": [max(p, 0) for p in truth["position"]],
        "labels": truth["label"],
        "loss_mask": truth["weight"],
    }
    if not with_tokens:
        fields.pop("input_ids")
    cuts = [int(c) for c in layout]
    while cuts[-1] < total:
        cuts.append(min(cuts[-1] + 2 * cp, total))
    ranks = []
    for rank in range(cp):
        if mode == "contiguous":
            local = width // cp
            index = [b * width + rank * local + k for b in range(rows) for k in range(local)]
        else:
            index = [int(g) for a, b in zip(cuts, cuts[1:]) for g in _zigzag(a, b, cp, rank)]
        ranks.append({name: [values[g] for g in index] for name, values in fields.items()})
    return {"layout": cuts[: len(sequences) + 1], "rows": rows, "width": width, "ranks": ranks}


# The reproducers' shared part: loading files that import their package's siblings, megatron
# played by placeholders (the split path calls none of it but PackedSeqParams, a record), and
# the ground truth (`problems`) written out again, so the script needs only torch and the wheels.
_REPRO_COMMON = r'''
import contextlib
import importlib.abc
import os

import torch


class PackedSeqParams:
    """megatron-core's PackedSeqParams as the split path uses it: a record of its fields."""

    def __init__(self, **fields):
        vars(self).update(fields)


class MegatronStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `megatron` import answered by a placeholder module."""

    def find_spec(self, name, path, target=None):
        if name == "megatron" or name.startswith("megatron."):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        if spec.name == "megatron.core":
            module.__version__ = "0.16.0"
        if spec.name == "megatron.core.packed_seq_params":
            module.PackedSeqParams = PackedSeqParams
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def megatron_stand_in():
    finder = MegatronStandIn()
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for key in saved:
        del sys.modules[key]
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for key in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[key]
        sys.modules.update(saved)


def load_in_package(wheel, relative, package, stubs):
    """load_from_wheel, the module named inside `package` so its relative imports find the
    stubs named there."""
    folder = Path(tempfile.mkdtemp(prefix="repro-src-"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(relative, folder)
    saved = {key: sys.modules.get(key) for key in stubs}
    for key, attributes in stubs.items():
        module = _Placeholder(key)
        module.__path__ = []
        for attribute, value in attributes.items():
            setattr(module, attribute, value)
        sys.modules[key] = module
    try:
        name = f"{package}.released_{Path(relative).stem}"
        loader = importlib.machinery.SourceFileLoader(name, str(folder / relative))
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        loader.exec_module(module)
        return module
    finally:
        for key, before in saved.items():
            if before is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = before


class Ranks:
    """megatron's parallel_state for one rank, one process playing every rank."""

    def __init__(self, cp, rank, tp):
        self.cp, self.rank, self.tp = cp, rank, tp

    def get_context_parallel_world_size(self):
        return self.cp

    def get_context_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_context_parallel_group(self):
        return None


def logger(*args, **kwargs):
    import logging

    return logging.getLogger("repro")


def sequences(lengths):
    """Token ids unique over the micro-batch (0 is padding)."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


def expected_slots(layout, rows, width, cp, rank, mode):
    """The global slots rank `rank` must hold: zigzag chunks rank and 2*cp-1-rank of every
    sample (the tail's padding in segments of 2*cp), or block `rank` of every row."""
    if mode == "contiguous":
        local = width // cp
        return [b * width + rank * local + k for b in range(rows) for k in range(local)]
    cuts = list(layout)
    while cuts[-1] < rows * width:
        cuts.append(min(cuts[-1] + 2 * cp, rows * width))
    index = []
    for a, b in zip(cuts, cuts[1:]):
        chunk = (b - a) // (2 * cp)
        index += range(a + rank * chunk, a + (rank + 1) * chunk)
        index += range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk)
    return index


def problems(outputs):
    """Each rank's slots against the ground truth of the row the release laid out: a real
    token with its own position and next token as label, weight 1 where a next token exists,
    0 on padding."""
    found = []
    layout, rows, width = outputs["layout"], outputs["rows"], outputs["width"]
    seqs = sequences(CASE["lengths"])
    total = rows * width
    token, position, label, weight = [0] * total, [None] * total, [None] * total, [0] * total
    owner = ["padding"] * total
    for i, tokens in enumerate(seqs):
        for p in range(layout[i + 1] - layout[i]):
            g = layout[i] + p
            if p < len(tokens):
                token[g], position[g], owner[g] = tokens[p], p, f"sequence {i} position {p}"
            if p + 1 < len(tokens):
                label[g], weight[g] = tokens[p + 1], 1
    mode = OPTIONS.get("cp_partition_mode", "zigzag")
    for rank, got in enumerate(outputs["ranks"]):
        index = expected_slots(layout, rows, width, CASE["cp"], rank, mode)
        for name, values in got.items():
            if len(values) != len(index):
                found.append(f"rank {rank}: {name} holds {len(values)} slots, not {len(index)}")
        for slot, g in enumerate(index):
            want = {"loss_mask": weight[g]}
            if position[g] is not None:
                want.update(input_ids=token[g], position_ids=position[g])
            if weight[g]:
                want["labels"] = label[g]
            for name, value in want.items():
                if name in got and slot < len(got[name]) and got[name][slot] != value:
                    found.append(f"rank {rank}, local slot {slot} (global slot {g}, {owner[g]}): "
                                 f"{name} expected {value}, got {got[name][slot]}")
    if len(found) > 12:
        found = found[:12] + [f"... and {len(found) - 12} more"]
    return found
'''

_BATCH_REPRODUCER = (
    _REPRO_COMMON
    + r'''
BRIDGE_VERSION = BRIDGE_PIN


def release_outputs(wheel):
    """Each rank's labels, positions, weights (and tokens) after ms-swift's collator and
    prepare_batch. The mcore-bridge wheel: $MCORE_BRIDGE_WHEEL, else pip download."""
    bridge_wheel = os.environ.get("MCORE_BRIDGE_WHEEL") or fetch_wheel("mcore-bridge",
                                                                       BRIDGE_VERSION)
    none = {}
    npu = {"is_torch_npu_available": lambda: False}
    with megatron_stand_in():
        bridge = load_in_package(bridge_wheel, "mcore_bridge/utils/megatron_utils.py",
                                 "mcore_bridge.utils", {"transformers": none,
                                 "mcore_bridge.utils.logger": {"get_logger": logger}})
        params = load_in_package(wheel, "swift/utils/transformers_utils.py", "swift.utils", {
            "transformers": none, "transformers.integrations": none,
            "transformers.trainer_utils": none, "swift.utils.logger": {"get_logger": logger},
            "swift.utils.utils": none})
        utils = load_in_package(wheel, "swift/megatron/utils/utils.py", "swift.megatron.utils", {
            "transformers": none, "transformers.utils": npu, "swift": none, "swift.tuners": none,
            "swift.utils": {"get_logger": logger,
                            "get_packed_seq_params": params.get_packed_seq_params}})
        packages = {"swift": none, "swift.megatron": none, "swift.megatron.utils": none}
        split = load_in_package(wheel, "swift/megatron/utils/megatron_lm_utils.py",
                                "swift.megatron.utils", {
            **packages, "mcore_bridge": {"split_cp_inputs": bridge.split_cp_inputs},
            "transformers": none, "transformers.utils": npu, "swift.utils": {"get_logger": logger},
            "swift.megatron.utils.megatron_fsdp_checkpoint": none,
            "swift.megatron.utils.patcher": none})
        trainer = load_in_package(wheel, "swift/megatron/trainers/utils.py",
                                  "swift.megatron.trainers", {
            **packages, "accelerate": none, "accelerate.utils": none, "swift.dataloader": none,
            "swift.megatron.utils": {
                "get_batch_on_this_cp_rank": split.get_batch_on_this_cp_rank,
                "get_packed_seq_params": utils.get_packed_seq_params},
            "swift.utils": {"get_logger": logger, "to_device": lambda data, *a, **k: data,
                            "get_current_device": lambda: "cpu"}})
        collator = load_in_package(wheel, "swift/template/base.py", "swift.template", {
            "modelscope": none, "modelscope.hub": none, "modelscope.hub.utils": none,
            "modelscope.hub.utils.utils": none, "peft": none,
            "PIL": {"Image": types.SimpleNamespace(Image=object)}, "transformers": none,
            "transformers.integrations": none, "transformers.utils": none, "swift": none,
            "swift.utils": {"get_logger": logger,
                            "retry_decorator": lambda *a, **k: lambda function: function},
            "swift.template": none, "swift.template.template_inputs": none,
            "swift.template.utils": none, "swift.template.vision_utils": none})
    o = {**DEFAULTS, **OPTIONS}
    cp, tp = CASE["cp"], CASE["tp"]
    args = types.SimpleNamespace(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=1,
        sequence_parallel=o["sequence_parallel"], fp8_format=o["fp8_format"],
        fp8=o["fp8_format"], fp4_format=o["fp4_format"], fp4=o["fp4_format"],
        fp8_recipe=o["fp8_recipe"], attention_backend=o["attention_backend"],
        task_type="causal_lm", padding_free=o["padding_free"], is_multimodal=o["is_multimodal"],
        cp_partition_mode=o["cp_partition_mode"])
    seqs = sequences(CASE["lengths"])
    outputs = {"ranks": []}
    sys.modules["transformers.utils"] = types.SimpleNamespace(**npu)  # asked at call time
    for rank in range(cp):
        template = collator.Template.__new__(collator.Template)
        vars(template).update(tokenizer=types.SimpleNamespace(pad_token_id=0),
                              padding_side=o["padding_side"], mode="train", use_megatron=True,
                              padding_free=o["padding_free"], sequence_parallel_size=cp)
        samples = []
        for tokens in seqs:  # what Template.encode gives the collator for training
            sample = {"input_ids": list(tokens), "labels": [-100, *tokens[1:]],
                      "length": len(tokens)}
            if o["loss_scale"]:
                sample["loss_scale"] = [0.0] + [1.0] * (len(tokens) - 1)
            samples.append(sample)
        data = template._data_collator(samples, padding_to=utils.get_padding_to(args))
        rows, width = data["input_ids"].shape
        bridge.mpu = split.mpu = trainer.mpu = Ranks(cp, rank, tp)
        batch = trainer.prepare_batch(args, data)
        labels = batch["labels"].reshape(-1)
        weight = (labels != -100).double()
        if batch.get("loss_scale") is not None:
            weight = weight * batch["loss_scale"].reshape(-1).double()
        got = {"position_ids": batch["position_ids"].reshape(-1).tolist(),
               "labels": labels.tolist(), "loss_mask": weight.tolist()}
        if not o["is_multimodal"]:
            got["input_ids"] = batch["input_ids"].reshape(-1).tolist()
        outputs["ranks"].append(got)
        psp = batch.get("packed_seq_params")
        n = len(seqs)
        outputs["layout"] = ([k * width for k in range(n + 1)] if psp is None
                             else [int(c) for c in psp.cu_seqlens_q[: n + 1]])
        outputs["rows"], outputs["width"] = rows, width
    return outputs
'''
)

_SPLIT_REPRODUCER = (
    _REPRO_COMMON
    + r'''
def release_outputs(wheel):
    """Each rank's split of the packed fields (tokens, positions, next-token labels, weights)."""
    with megatron_stand_in():
        bridge = load_in_package(wheel, "mcore_bridge/utils/megatron_utils.py",
                                 "mcore_bridge.utils", {"transformers": {},
                                 "mcore_bridge.utils.logger": {"get_logger": logger}})
    o = {**DEFAULTS, **OPTIONS}
    cp, tp = CASE["cp"], CASE["tp"]
    seqs = sequences(CASE["lengths"])
    unit = 2 * cp * tp
    padded = [-(-len(s) // unit) * unit for s in seqs]
    rows = len(seqs) if o["cu_seqlens"] == "rows" else 1
    width = max(padded) if rows > 1 else sum(padded)
    layout = [0]
    for n in padded:
        layout.append(layout[-1] + (width if rows > 1 else n))
    total = rows * width
    fields = {k: [v] * total for k, v in
              (("input_ids", 0), ("position_ids", 0), ("labels", -100), ("loss_mask", 0))}
    for i, tokens in enumerate(seqs):
        for p, token in enumerate(tokens):
            g = layout[i] + p
            fields["input_ids"][g], fields["position_ids"][g] = token, p
            if p + 1 < len(tokens):
                fields["labels"][g], fields["loss_mask"][g] = tokens[p + 1], 1
    shape, dim = o["dim"].split(":")
    cu = None if rows > 1 else torch.tensor(layout, dtype=torch.int32)
    kwargs = {} if o["cp_partition_mode"] == "zigzag" else {"cp_partition_mode": "contiguous"}
    outputs = {"layout": layout, "rows": rows, "width": width, "ranks": []}
    for rank in range(cp):
        bridge.mpu = Ranks(cp, rank, tp)
        got = {}
        for name, values in fields.items():
            x = torch.tensor(values).reshape(rows, width)
            if shape != "bs":
                x = torch.stack([x, x], dim=-1)
                x = x if shape == "bsh" else x.transpose(0, 1).contiguous()
            y = bridge.split_cp_inputs(x, cu, int(dim), **kwargs)
            if shape == "sbh":
                y = y.transpose(0, 1)
            got[name] = (y if shape == "bs" else y[..., 0]).reshape(-1).tolist()
        outputs["ranks"].append(got)
    return outputs
'''
)

_ROUND_TRIP_REPRODUCER = (
    _REPRO_COMMON
    + r'''
def thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """TransformerEngine's thd_partition_indices_kernel (a CUDA kernel), transcribed."""
    cu = torch.as_tensor(cu_seqlens).long().cpu()
    assert not bool((cu % (world_size * 2)).any()), "the kernel's assert"
    cu_s = cu // world_size
    token = torch.arange(int(total_tokens) // world_size)
    seq = torch.searchsorted(cu_s[1:-1], token, right=True)
    seq_len = cu_s[seq + 1] - cu_s[seq]
    index = token - cu_s[seq]
    offset = torch.where(index < seq_len // 2, rank, (world_size - 1) * 2 - rank)
    return index + cu_s[seq] * world_size + seq_len // 2 * offset


class Collectives:
    """The module's torch, all_gather handing back every rank's shard."""

    def __init__(self, shards):
        self.shards = shards
        self.distributed = self

    def all_gather(self, outputs, tensor, group=None):
        for out, shard in zip(outputs, self.shards):
            out.copy_(shard)

    def __getattr__(self, name):
        return getattr(torch, name)


def load_inverse(wheel):
    none = {}
    if SPEC["call"] == "trainer":  # calls no megatron code: placeholders for its imports
        packages = {"swift": none, "swift.megatron": none, "swift.megatron.utils": none}
        with megatron_stand_in():
            return load_in_package(wheel, SPEC["relative"], SPEC["package"], {
                **packages, "accelerate": none, "accelerate.utils": none,
                "swift.dataloader": none, "swift.utils": {"get_logger": logger}})
    try:  # its undo is megatron-core's _undo_attention_load_balancing: needs megatron-core
        import megatron.core  # noqa: F401
    except ImportError:
        print("this reproducer needs megatron-core (pip install megatron-core)")
        raise SystemExit(2) from None
    if SPEC["call"] == "bridge":
        stubs = {"transformers": none, "mcore_bridge.utils.logger": {"get_logger": logger}}
    else:
        stubs = {"transformers": none,
                 "transformers.utils": {"is_torch_npu_available": lambda: False},
                 "swift": none, "swift.tuners": none, "swift.utils": {"get_logger": logger}}
    module = load_in_package(wheel, SPEC["relative"], SPEC["package"], stubs)
    undo = module._undo_attention_load_balancing
    namespace = dict(undo.__globals__, is_te_min_version=lambda *a, **k: True,
                     tex=types.SimpleNamespace(
                         thd_get_partitioned_indices=thd_get_partitioned_indices))
    module._undo_attention_load_balancing = types.FunctionType(
        undo.__code__, namespace, undo.__name__, undo.__defaults__, undo.__closure__)
    return module


def original():
    rows, width = SPEC["rows"], SPEC["width"]
    return torch.arange(1, rows * width + 1, dtype=torch.float64).reshape(rows, width)


def split(values, cp, rank):
    """What each rank holds: zigzag chunks of every segment of cu (whole rows without one), or
    block `rank` of every row."""
    width = SPEC["width"]
    if SPEC["mode"] == "contiguous":
        local = width // cp
        return values[:, rank * local:(rank + 1) * local]
    cuts = SPEC["cu"] or [0, width]
    index = []
    for a, b in zip(cuts, cuts[1:]):
        chunk = (b - a) // (2 * cp)
        index += range(a + rank * chunk, a + (rank + 1) * chunk)
        index += range(a + (2 * cp - 1 - rank) * chunk, a + (2 * cp - rank) * chunk)
    return values[:, index]


def release_outputs(wheel):
    module = load_inverse(wheel)
    cp, tp = CASE["cp"], CASE["tp"]
    shape, dim = SPEC["dim"].split(":")
    params = None
    if SPEC["cu"] is not None:
        cu = torch.tensor(SPEC["cu"], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                                 seq_lens=torch.tensor(CASE["lengths"]))
    shards = []
    for rank in range(cp):
        x = split(original(), cp, rank)
        if shape != "bs":
            x = torch.stack([x * 2, x * 2 + 1], dim=-1)
            x = x if shape == "bsh" else x.transpose(0, 1).contiguous()
        shards.append(x)
    module.torch = Collectives(shards)
    outputs = {"ranks": []}
    for rank in range(cp):
        module.mpu = Ranks(cp, rank, tp)
        if SPEC["call"] == "trainer":
            got = module.reconstruct_tensor_cp(cp, shards[rank], params, len(CASE["lengths"]),
                                               SPEC["mode"])
        else:
            got = module.reconstruct_tensor_cp(shards[rank], params, int(dim),
                                               cp_partition_mode=SPEC["mode"])
        if shape == "sbh":
            got = got.transpose(0, 1)
        if shape != "bs":
            got = torch.div(got[..., 0], 2, rounding_mode="floor")
        outputs["ranks"].append(got.tolist())
    return outputs


def problems(outputs):
    """Each rank's result against the original: every real token's value back in its slot."""
    expected = original()[:, :SPEC["expected_width"]]
    owner = {}
    for i, n in enumerate(CASE["lengths"]):
        for p in range(n):
            owner[SPEC["layout"][i] + p] = f"sequence {i} position {p}"
    found = []
    for rank, got in enumerate(outputs["ranks"]):
        got = torch.tensor(got, dtype=torch.float64)
        if got.shape != expected.shape:
            found.append(f"rank {rank}: shape {tuple(got.shape)}, the original "
                         f"{tuple(expected.shape)}")
            continue
        for b in range(expected.shape[0]):
            for s in range(expected.shape[1]):
                g = b * SPEC["width"] + s
                if g in owner and got[b, s] != expected[b, s]:
                    have = owner.get(int(got[b, s]) - 1, "padding")
                    found.append(f"rank {rank}: row {b} slot {s} ({owner[g]}) gets the value "
                                 f"of {have}")
    if len(found) > 12:
        found = found[:12] + [f"... and {len(found) - 12} more"]
    return found
'''
)
