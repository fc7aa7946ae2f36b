"""The released CP preprocessing functions training can call (`cp.preprocess=LIBRARY@VERSION`),
each called the way its library calls it and returned in the contract's interface
(`recipe/parallel/cp/contract.py`). The checker (`recipe/checks/upstream/`) checks the same
loaded functions; this module is the part training needs.

One table, `LIBRARIES`: per library, the functions, the file each lives in, and the imports
stubbed to load that file without the package's `__init__`:
- verl: `verl/models/mcore/util.py`, with `verl.utils.device` (only `is_npu_available`, set to
  False: the NPU branch is not a CPU path) and `verl.utils.model` (`CausalLMOutputForPPO`, a
  return type of functions not checked) stubbed; `verl/__init__` imports ray.
- megatron-bridge: the per-model-family copies of `preprocess_packed_seqs`, with each family's
  `transformer_config` module stubbed (a config dataclass the function never reads).
The functions read cp/tp from megatron's `parallel_state` (`mpu`); a stand-in answers with the
drawn rank and sizes, so one process plays every rank.

Every option of a function's signature is either drawn, fixed with the reason, or unknown; an
unknown one refuses the load (exit 2 in the checker, a start-up error in training), since a new
option may change the layout.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from recipe.upstream.source import INSTALLED, UpstreamUnavailable, load_module, source_file


@dataclass(frozen=True)
class Library:
    """A library: its PyPI distribution, its functions, and the releases checked by default."""

    distribution: str
    targets: tuple
    releases: tuple[str, ...] = ()

    @property
    def installed_only(self) -> bool:
        """Checked only where it is installed (torch: its wheel is too large to fetch)."""
        return self.releases == (INSTALLED,)


class ParallelStateStandIn:
    """What the upstream functions ask of megatron's parallel_state, for one drawn rank."""

    def __init__(self, cp_size: int, cp_rank: int, tp_size: int):
        self.cp_size, self.cp_rank, self.tp_size = cp_size, cp_rank, tp_size

    def get_context_parallel_world_size(self) -> int:
        return self.cp_size

    def get_context_parallel_rank(self) -> int:
        return self.cp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_context_parallel_group(self):
        return None  # a checker's gather stand-in plays the collectives and ignores the group


@dataclass(frozen=True)
class Target:
    """One upstream function with the zigzag contract: where it lives and how it takes its
    input."""

    name: str  # as the CLI and the report name it
    file: str  # inside the wheel
    functions: tuple[str, ...]  # its name, then older names of the same function
    style: str  # "thd": a nested (jagged) batch of sequences; "bshd": [b, s] with a mask
    stubs: dict = field(default_factory=dict)
    inverse: tuple[str, ...] = ()  # the function that gathers a sharded output back (names)


_VERL_STUBS = {
    "verl.utils.device": {"is_npu_available": False},
    "verl.utils.model": {},
}
_VERL_UTIL = "verl/models/mcore/util.py"
_BRIDGE_MODELS = "megatron/bridge/models"
_EXAONE = "megatron.bridge.models.exaone.exaone45.modelling_exaone45"

LIBRARIES: dict[str, Library] = {
    "verl": Library(
        "verl",
        (
            # named preprocess_thd_no_padding up to 0.7.1
            Target(
                "preprocess_thd_engine",
                _VERL_UTIL,
                ("preprocess_thd_engine", "preprocess_thd_no_padding"),
                "thd",
                _VERL_STUBS,
                ("postprocess_thd_engine", "postprocess_thd_no_padding"),
            ),
            Target(
                "preprocess_packed_seqs",
                _VERL_UTIL,
                ("preprocess_packed_seqs",),
                "bshd",
                _VERL_STUBS,
                ("postprocess_packed_seqs",),
            ),
        ),  # fmt: skip
        releases=("0.7.1", "0.8.0", "0.9.1"),
    ),
    "megatron-bridge": Library(
        "megatron-bridge",
        (
            Target(
                "qwen3_vl.preprocess_packed_seqs",
                f"{_BRIDGE_MODELS}/qwen_vl/modelling_qwen3_vl/utils.py",
                ("preprocess_packed_seqs",),
                "bshd",
                {"megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_config": {}},
            ),
            Target(
                "exaone45.preprocess_packed_seqs",
                f"{_BRIDGE_MODELS}/exaone/exaone45/modelling_exaone45/utils.py",
                ("preprocess_packed_seqs",),
                "bshd",
                {f"{_EXAONE}.transformer_config": {}},
            ),
        ),
        releases=("0.6.2",),
    ),
}

# Options every adapter sets itself, with why they are not drawn.
FIXED = {
    "input_ids": "the drawn sequences",
    "attention_mask": "the drawn mask",
    "pre_process": "True: the first pipeline stage, the one that shards the tokens",
    "need_roll": "both: False for tokens, positions and the loss mask, True for the labels",
    "pg_collection": "None: the rank is read from parallel_state, as without process groups",
    "local_cp_size": "None: dynamic CP needs megatron's dynamic CP groups (not drawn)",
}
# Options drawn, with their values (None = the function's default).
DRAWN = {
    "use_fp8_padding": (False, True),
    "min_local_rows": (None, 1, 2, 3, 5, 8, 13, 64),
    "pad_to_length_bucket": (None, 1, 2, 3, 4, 6, 8, 16, 100, 128),
}
# Not options of the function but of its input, drawn for the [b, s] + mask functions.
INPUT_OPTIONS = {
    "mask_side": ("right", "left"),
    "mask_dtype": ("bool", "int64"),
}


def unknown_option(label: str, param: str, plugin: str) -> UpstreamUnavailable:
    """The refusal of an option nobody taught the checker: it may change the layout. `plugin`:
    the dotted module that must learn it."""
    return UpstreamUnavailable(
        f"{label} has an option the checker does not know: {param!r}. It may change the "
        f"layout, so the check stops; teach {plugin.replace('.', '/')}.py what it does (draw it "
        "or fix it with a reason)"
    )


def partition_options(function, label: str, plugin: str, fixed: dict[str, str],
                      drawn: dict[str, tuple] | None = None) -> tuple[dict, dict]:  # fmt: skip
    """(drawn, fixed) of `function`'s signature, in its order: each parameter is drawn (its
    values from `drawn`) or fixed (its reason from `fixed`); any other refuses the check
    (`unknown_option`). Every plugin partitions its functions' options through this."""
    chosen: dict[str, tuple] = {}
    skipped: dict[str, str] = {}
    for param in inspect.signature(function).parameters:
        if param in fixed:
            skipped[param] = fixed[param]
        elif drawn is not None and param in drawn:
            chosen[param] = drawn[param]
        else:
            raise unknown_option(label, param, plugin)
    return chosen, skipped


def _packed_seq_params_has(name: str) -> bool:
    from megatron.core.packed_seq_params import PackedSeqParams

    return name in inspect.signature(PackedSeqParams.__init__).parameters


@dataclass
class Released:
    """A target loaded from one release: its module, the function and its inverse, and the
    partition of the function's options (drawn, or fixed with the reason)."""

    library: str  # as the registry names it
    version: str
    distribution: str  # on PyPI
    target: Target
    module: object
    function_name: str
    inverse_name: str | None
    drawn: dict[str, tuple] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def function(self) -> Callable:
        return getattr(self.module, self.function_name)

    @property
    def label(self) -> str:
        return f"{self.library}@{self.version} {self.target.name}"

    def contract_function(self, options: dict, parallel_state=None) -> Callable:
        """The function as the checker calls it: (sequences, cu, cp, rank, tp) -> fields.

        Without `parallel_state` one process plays every rank: the function reads the rank it
        is asked for from a stand-in. In training, `parallel_state` is megatron's own, so the
        function reads this process's true rank, as it does in its library; a rank that
        disagrees with the one the recipe asks for is an error, not a silent mix."""
        call = thd_fields if self.target.style == "thd" else bshd_fields

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            if parallel_state is None:
                self.module.mpu = ParallelStateStandIn(cp_size, cp_rank, tp_size)
            else:
                self.module.mpu = parallel_state
                _check_true_rank(self.label, parallel_state, cp_size, cp_rank, tp_size)
            return call(self.function, sequences, options)

        return per_rank


def _check_true_rank(label: str, parallel_state, cp_size: int, cp_rank: int, tp_size: int):
    says = (
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    if says != (cp_size, cp_rank, tp_size):
        raise RuntimeError(
            f"{label}: megatron's parallel state says (cp size, cp rank, tp size) = {says}, the "
            f"recipe shards for {(cp_size, cp_rank, tp_size)}; the function would shard for "
            "another rank than the one training this micro-batch"
        )


def parse_spec(spec: str, libraries: Mapping | None = None) -> tuple[str, str | None]:
    """`LIBRARY[@VERSION]` -> (library, version or None for the installed release), the library
    one of `libraries` (training's `LIBRARIES` unless the checker passes its registry); the
    one parser of a spec, for training and the checker alike."""
    libraries = LIBRARIES if libraries is None else libraries
    library, _, version = spec.partition("@")
    if library not in libraries:
        known = ", ".join([*libraries, "megatron-core"])
        raise UpstreamUnavailable(f"unknown library {library!r}; known: {known}")
    return library, (None if version in ("", INSTALLED) else version)


def parse_preprocess_spec(text: str) -> tuple[str, str | None, Target]:
    """`verl@0.7.1`, `verl@installed`, `megatron-bridge@0.6.2/qwen3_vl.preprocess_packed_seqs`
    -> (library, version or None for the installed one, target). Without /FUNCTION: the
    library's first function (verl: preprocess_thd_engine)."""
    spec, _, function = text.partition("/")
    library, version = parse_spec(spec)
    if not spec.partition("@")[2]:
        raise UpstreamUnavailable(
            f"{text!r} names no version: write {library}@VERSION (a release on PyPI, e.g. "
            f"{library}@0.9.1) or {library}@installed"
        )
    targets = LIBRARIES[library].targets
    target = next((t for t in targets if t.name == function), None) if function else targets[0]
    if target is None:
        names = ", ".join(t.name for t in targets)
        raise UpstreamUnavailable(f"{library} has no checked function {function!r}; known: {names}")
    return library, version, target


@functools.cache
def training_preprocess(text: str) -> Callable:
    """The released function named by `cp.preprocess=LIBRARY@VERSION[/FUNCTION]` in the
    contract's interface, at its default options, reading megatron's real parallel state (loaded
    once per process: the first call fetches the release's wheel if it is not cached)."""
    from recipe.parallel import groups

    library, version, target = parse_preprocess_spec(text)
    return load(library, version, target).contract_function({}, groups.megatron_parallel_state())


@functools.cache
def checking_preprocess(text: str) -> Callable:
    """The same function with one process playing every rank (the start-up check)."""
    library, version, target = parse_preprocess_spec(text)
    return load(library, version, target).contract_function({})


def load(library: str, version: str | None, target: Target) -> Released:
    path, version = source_file(LIBRARIES[library].distribution, version, target.file)
    tag = f"{library}_{version}_{target.name}".replace(".", "_").replace("-", "_")
    module = load_module(path, f"recipe_upstream_{tag}", target.stubs)
    logger = getattr(module, "logger", None)
    if logger is not None and not hasattr(logger, "warning_once"):
        # verl's package __init__ (not run here) adds Logger.warning_once; the function calls it
        # with a note on its own padding (not a finding), which stays at debug level here
        logger.warning_once = logger.debug
    name = next((n for n in target.functions if callable(getattr(module, n, None))), None)
    if name is None:
        raise UpstreamUnavailable(
            f"{library}@{version} has none of {', '.join(target.functions)} in {target.file}"
        )
    if _packed_seq_params_has("cp_partition_mode"):
        cp_layout = "zigzag only: the checker's ground truth is the zigzag layout"
    else:
        cp_layout = (
            "zigzag only: the installed megatron-core's PackedSeqParams has no "
            "cp_partition_mode, and the function refuses 'contiguous' without it"
        )
    drawn, skipped = partition_options(
        getattr(module, name), f"{library}@{version} {name}", __name__,
        {**FIXED, "cp_layout": cp_layout}, DRAWN,
    )  # fmt: skip
    if target.style == "bshd":
        drawn.update(INPUT_OPTIONS)
    inverse = next((n for n in target.inverse if callable(getattr(module, n, None))), None)
    if target.inverse and inverse is None:
        raise UpstreamUnavailable(
            f"{library}@{version} has none of {', '.join(target.inverse)} in {target.file}"
        )
    notes = (
        (f"every case also round-trips a per-token tensor through {inverse}",) if inverse else ()
    )
    return Released(
        library,
        version,
        LIBRARIES[library].distribution,
        target,
        module,
        name,
        inverse,
        drawn,
        skipped,
        notes,
    )


def padded_rows(values: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] rows holding each sequence at the mask's side, and the bool mask."""
    width = max(v.numel() for v in values) + 2
    rows = torch.zeros(len(values), width, dtype=values[0].dtype)
    mask = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        where = slice(0, v.numel()) if side == "right" else slice(width - v.numel(), width)
        rows[i, where] = v
        mask[i, where] = True
    return rows, mask


def nested(tensors: list) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def label_mask(n: int) -> torch.Tensor:
    return (torch.arange(n) + 1 < n).to(torch.int64)


def thd_fields(function: Callable, sequences, options: dict) -> dict:
    """verl's engine path: tokens and positions from one call, labels from the same call with
    need_roll=True (as model_forward rolls the label tensor), the loss mask sharded as a
    per-token tensor (1 where a next token exists)."""
    ids = nested([s.to(torch.int64) for s in sequences])
    tokens, params, positions = function(ids, pre_process=True, need_roll=False, **options)
    labels = function(ids, pre_process=True, need_roll=True, **options)[0]
    masks = nested([label_mask(s.numel()) for s in sequences])
    loss_mask = function(masks, pre_process=True, need_roll=False, **options)[0]
    return {
        "input_ids": tokens.reshape(-1),
        "position_ids": positions.reshape(-1),
        "labels": labels.reshape(-1),
        "loss_mask": loss_mask.reshape(-1),
        "cu_seqlens_padded": params.cu_seqlens_q_padded,
    }


def bshd_fields(function: Callable, sequences, options: dict) -> dict:
    """The packed-BSHD path: [b, s] rows with an attention mask; labels and the loss mask are
    [b, s] tensors sharded by the same function, as verl's and Bridge's forwards do."""
    options = dict(options)
    side = options.pop("mask_side", "right")
    dtype = getattr(torch, options.pop("mask_dtype", "bool"))
    sequences = [s.to(torch.int64) for s in sequences]
    per_token = {
        "input_ids": sequences,
        "labels": [torch.cat([s[1:], s.new_zeros(1)]) for s in sequences],
        "loss_mask": [label_mask(s.numel()) for s in sequences],
    }
    rows = {k: padded_rows(v, side)[0] for k, v in per_token.items()}
    mask = padded_rows(sequences, side)[1].to(dtype)
    sharded = {k: function(v, mask, pre_process=True, **options) for k, v in rows.items()}
    fields = {k: out[0].reshape(-1) for k, out in sharded.items()}
    return {
        **fields,
        "cu_seqlens_padded": sharded["input_ids"][1].cu_seqlens_q_padded,
    }
