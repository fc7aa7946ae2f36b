"""ms-swift's and mcore-bridge's released files, loaded for the checks: the stand-ins for their
dependencies (TransformerEngine's partition kernel, an NPU probe, strict `args` and template
objects that refuse an option the checks do not know), the stubs of each file's imports, and which
mcore-bridge release an ms-swift release runs on."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

from recipe.checks.upstream.kit.checked import CheckTarget
from recipe.checks.upstream.libraries.ms_swift.reproducers import TEPartitionStandIn
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


def with_te_stand_in(function: Callable) -> Callable:
    """megatron-core's function with TE's kernel played by TEPartitionStandIn (a copy: the
    installed megatron-core is left as it is)."""
    namespace = dict(function.__globals__)
    namespace["tex"] = TEPartitionStandIn
    namespace["is_te_min_version"] = lambda *args, **kwargs: True
    return types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )


class UnknownOption(Exception):
    """The released code read an option (an attribute of args or of the template) that this
    adapter does not know; the check refuses (UpstreamUnavailable) rather than guess it."""


class Strict:
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
        raise UnknownOption(f"{self._what}.{name}")


@contextlib.contextmanager
def npu_off():
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
def swapped(namespace: dict, **values):
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


def tag(version: str) -> str:
    return re.sub(r"\W", "_", version)


def released_function(module, name: str, label: str, file: str) -> Callable:
    function = getattr(module, name, None)
    if not callable(function):
        raise UpstreamUnavailable(f"{label} has no {name} in {file}")
    return function


@functools.cache
def load_bridge(version: str | None) -> tuple[types.ModuleType, str]:
    """mcore-bridge's megatron_utils.py from this release, its megatron-core undo with TE's
    kernel played (see with_te_stand_in)."""
    path, version = source_file(BRIDGE, version, BRIDGE_FILE)
    # a name inside mcore_bridge.utils, so the file's `from .logger import` finds the stub
    module = load_module(path, f"mcore_bridge.utils.recipe_megatron_utils_{tag(version)}",
                         BRIDGE_STUBS)  # fmt: skip
    for name in ("split_cp_inputs", "reconstruct_tensor_cp"):
        released_function(module, name, f"{BRIDGE}@{version}", BRIDGE_FILE)
    undo = getattr(module, "_undo_attention_load_balancing", None)
    if undo is not None:
        module._undo_attention_load_balancing = with_te_stand_in(undo)
    return module, version


@dataclass
class Swift:
    """One ms-swift release's files on one mcore-bridge release."""

    version: str
    bridge: types.ModuleType
    bridge_version: str
    collator: types.ModuleType
    utils: types.ModuleType
    split: types.ModuleType
    trainer: types.ModuleType


def bridge_version_for(version: str | None) -> str | None:
    """The mcore-bridge release to run ms-swift `version` on (None: the installed ones)."""
    if version is None:
        return None
    bridge = BRIDGE_FOR_SWIFT.get(version)
    if bridge is None:
        raise UpstreamUnavailable(
            f"{SWIFT}@{version}: which mcore-bridge release it runs on is not known here; add it "
            "to BRIDGE_FOR_SWIFT in recipe/checks/upstream/libraries/ms_swift/release.py (the "
            "newest its requirement allows whose split runs on CPU tensors: 1.6.5 or later)"
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
                    "recipe/checks/upstream/libraries/ms_swift/release.py"
                )
            return bridge
    raise UpstreamUnavailable(f"{SWIFT}@{version} does not require mcore-bridge (METADATA)")


@functools.cache
def load_swift(version: str | None) -> Swift:
    bridge, bridge_version = load_bridge(bridge_version_for(version))
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
        return load_module(path, f"{package}.recipe_{name}_{tag(found)}", stubs), found

    params, version = load(PARAMS_FILE, "transformers_utils")
    label = f"{SWIFT}@{version}"
    released["params"] = released_function(params, "get_packed_seq_params", label, PARAMS_FILE)
    utils, _ = load(UTILS_FILE, "utils")
    split, _ = load(SPLIT_FILE, "megatron_lm_utils")
    for name, module, file in (
        ("get_packed_seq_params", utils, UTILS_FILE),
        ("get_padding_to", utils, UTILS_FILE),
        ("reconstruct_tensor_cp", utils, UTILS_FILE),
        ("get_batch_on_this_cp_rank", split, SPLIT_FILE),
    ):
        released[name] = released_function(module, name, label, file)
    trainer, _ = load(TRAINER_FILE, "trainer_utils")
    collator, _ = load(COLLATOR_FILE, "base")
    for name, module, file in (
        ("prepare_batch", trainer, TRAINER_FILE),
        ("reconstruct_tensor_cp", trainer, TRAINER_FILE),
        ("Template", collator, COLLATOR_FILE),
    ):
        released_function(module, name, label, file)
    undo = getattr(utils, "_undo_attention_load_balancing", None)
    if undo is not None:
        utils._undo_attention_load_balancing = with_te_stand_in(undo)
    return Swift(version, bridge, bridge_version or "installed", collator, utils, split, trainer)


def settings(defaults: dict, options: dict) -> dict:
    unknown = set(options) - set(defaults)
    if unknown:
        raise UpstreamUnavailable(f"unknown options {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **options}


def token_sequences(lengths) -> list[list[int]]:
    """Token ids unique over the micro-batch (0 is padding)."""
    stride = max(lengths) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(lengths)]


@dataclass
class Target(CheckTarget):
    name: str
    file: str
    kind: type

    def load(self, library: str, distribution: str, version: str | None):
        return self.kind.build(library, distribution, version, self)
