"""Adapters: each released CP preprocessing function, called the way its library calls it and
returned in the checker's contract (`recipe/parallel/cp/contract.py`).

One registry, `LIBRARIES`: per library, the functions checked, the file each lives in, and the
imports stubbed to load that file without the package's `__init__`:
- verl: `verl/models/mcore/util.py`, with `verl.utils.device` (only `is_npu_available`, set to
  False: the NPU branch is not a CPU path) and `verl.utils.model` (`CausalLMOutputForPPO`, a
  return type of functions not checked) stubbed; `verl/__init__` imports ray.
- megatron-bridge: the per-model-family copies of `preprocess_packed_seqs`, with each family's
  `transformer_config` module stubbed (a config dataclass the function never reads).
The functions read cp/tp from megatron's `parallel_state` (`mpu`); the adapter gives the loaded
module a stand-in that answers with the drawn rank and sizes, so one process plays every rank.

Every option of a function's signature is either drawn, fixed with the reason, or unknown; an
unknown one refuses the check (exit 2), since a new option may change the layout.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from recipe.parallel.cp.contract import Impact, global_batch, index_preprocess
from recipe.upstream.checked import (
    CheckTarget,
    ContractChecked,
    Finding,
    Library,
    function_line,
    reproducer_source,
)
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file


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
        return None  # the gather is played by _GatherStandIn, which ignores the group


class _DistributedStandIn:
    """torch.distributed as a postprocess function sees it while one process plays every rank:
    all_gather hands back every rank's shard as that rank's own preprocess call produced it."""

    def __init__(self, shards: list[torch.Tensor]):
        self._shards = shards

    def all_gather(self, outputs: list, tensor, group=None) -> None:
        for out, shard in zip(outputs, self._shards, strict=True):
            out.copy_(shard)

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)


class _GatherStandIn:
    """The module's `torch` with its collectives played (see _DistributedStandIn)."""

    def __init__(self, shards: list[torch.Tensor]):
        self.distributed = _DistributedStandIn(shards)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@dataclass(frozen=True)
class Target(CheckTarget):
    """One upstream function with the zigzag contract: where it lives and how it takes its
    input."""

    name: str  # as the CLI and the report name it
    file: str  # inside the wheel
    functions: tuple[str, ...]  # its name, then older names of the same function
    style: str  # "thd": a nested (jagged) batch of sequences; "bshd": [b, s] with a mask
    stubs: dict = field(default_factory=dict)
    inverse: tuple[str, ...] = ()  # the function that gathers a sharded output back (names)

    def load(self, library: str, distribution: str, version: str | None) -> Loaded:
        return load(library, version, self)


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


def _packed_seq_params_has(name: str) -> bool:
    from megatron.core.packed_seq_params import PackedSeqParams

    return name in inspect.signature(PackedSeqParams.__init__).parameters


@dataclass
class Loaded(ContractChecked):
    """A target loaded from one release: its function and the options it draws."""

    target: Target | None = None
    module: object = None
    function_name: str = ""
    inverse_name: str | None = None

    @property
    def function(self) -> Callable:
        return getattr(self.module, self.function_name)

    @property
    def line(self) -> int:
        return function_line(self.module, self.function_name)

    def finding(self, case, options: dict) -> Finding | None:
        """The zigzag contract on every rank, then the round trip through the inverse."""
        found = super().finding(case, options)
        if found is not None or self.inverse_name is None:
            return found
        lengths, cp_size, tp_size = case
        try:
            problem = self.round_trip_problem(lengths, cp_size, tp_size, options)
            impact = Impact.MISPLACED
        except Exception as err:  # noqa: BLE001 (an upstream function raising is the finding)
            problem = (
                f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: the round trip through "
                f"{self.inverse_name} raises {type(err).__name__}: {err}"
            )
            impact = Impact.RAISES
        if problem is None:
            return None
        return Finding(
            {"lengths": list(lengths), "cp": cp_size, "tp": tp_size, "round_trip": True},
            tuple(sorted(options.items())),
            impact,
            problem,
        )

    def reproducer(self, finding: Finding) -> str | None:
        if finding.case.get("round_trip"):
            return None  # the gather needs every rank's collective: not one standalone script
        helpers = [_nested, _label_mask, _padded_rows]
        helpers.append(_thd_fields if self.target.style == "thd" else _bshd_fields)
        body = "\n\n".join(inspect.getsource(h) for h in helpers)
        body = body.replace(
            "_thd_fields" if self.target.style == "thd" else "_bshd_fields", "fields"
        )
        head = REPRODUCER_CALL.format(
            stubs=dict(self.target.stubs), file=self.file, function=self.function_name
        )
        title = (
            f"{self.label} ({self.file}:{self.line}): {finding.impact.label} on "
            f"{_case_text(finding.case)}"
        )
        return reproducer_source(title, finding, head + "\n\n" + body + "\n\n" +
                                 ZIGZAG_PROBLEMS, self.distribution, self.version)  # fmt: skip

    def truth_outputs(self, finding: Finding) -> list[dict]:
        """Every rank's fields from the ground truth (the recipe's index) on the case."""
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        stride = max(lengths) + 1
        sequences = [torch.arange(n) + 1 + stride * i for i, n in enumerate(lengths)]
        batch = global_batch([s.tolist() for s in sequences], cp, tp)
        outputs = []
        for rank in range(cp):
            got = index_preprocess(sequences, batch.cu_seqlens_padded, cp, rank, tp)
            outputs.append({k: v.tolist() for k, v in got.items()})
            outputs[-1]["cu_seqlens_padded"] = batch.cu_seqlens_padded.tolist()
        return outputs

    def round_trip_problem(self, lengths, cp_size: int, tp_size: int, options: dict) -> str | None:
        """Shard a per-token tensor on every rank, gather it back through the library's own
        postprocess function on every rank: where it differs from the original, or None."""
        if self.inverse_name is None:
            return None
        options = dict(options)
        side = options.pop("mask_side", "right")
        dtype = getattr(torch, options.pop("mask_dtype", "bool"))
        stride = max(lengths) + 1
        values = [
            torch.arange(n, dtype=torch.float64) + 1 + stride * i for i, n in enumerate(lengths)
        ]
        if self.target.style == "thd":
            given = _nested(values)
            extra = {}
        else:
            given, mask = _padded_rows(values, side)
            extra = {"attention_mask": mask.to(dtype)}
        shards, params = [], None
        for rank in range(cp_size):
            self.module.mpu = ParallelStateStandIn(cp_size, rank, tp_size)
            out = self.function(given, *extra.values(), pre_process=True, **options)
            shards.append(out[0])
            params = out[1]
        inverse = getattr(self.module, self.inverse_name)
        try:
            self.module.torch = _GatherStandIn(shards)
            for rank in range(cp_size):
                self.module.mpu = ParallelStateStandIn(cp_size, rank, tp_size)
                if self.target.style == "thd":
                    back = inverse(shards[rank], params, given, len(lengths)).unbind()
                else:
                    rows = inverse(shards[rank], params, extra["attention_mask"], *given.shape)
                    back = [row[m] for row, m in zip(rows, extra["attention_mask"].bool())]
                for i, (want, got) in enumerate(zip(values, back)):
                    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
                        return (
                            f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: rank {rank}: "
                            f"{self.inverse_name} gives sequence {i} back as "
                            f"{_head(got)}, sharded from {_head(want)}"
                        )
        finally:
            self.module.torch = torch
        return None

    @property
    def label(self) -> str:
        return f"{self.library}@{self.version} {self.target.name}"

    def contract_function(self, options: dict, parallel_state=None) -> Callable:
        """The function as the checker calls it: (sequences, cu, cp, rank, tp) -> fields.

        Without `parallel_state` one process plays every rank: the function reads the rank it
        is asked for from a stand-in. In training, `parallel_state` is megatron's own, so the
        function reads this process's true rank, as it does in its library; a rank that
        disagrees with the one the recipe asks for is an error, not a silent mix."""
        call = _thd_fields if self.target.style == "thd" else _bshd_fields

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            if parallel_state is None:
                self.module.mpu = ParallelStateStandIn(cp_size, cp_rank, tp_size)
            else:
                self.module.mpu = parallel_state
                _check_true_rank(self.label, parallel_state, cp_size, cp_rank, tp_size)
            return call(self.function, sequences, options)

        return per_rank

    def broken_copy(self, part: str = "function") -> Loaded:
        """The negative control: a copy with one deliberate off-by-one. part="function": the
        sharding function's back chunk starts one row late; part="inverse": the gathering
        function reads each sequence one row late (the round trip's own control)."""
        mutations = {
            "function": "remain_start = seqlen_padded_i - half_seqlen * (cp_rank + 1)",
            "inverse": "packed_start_idx = cu_padded_cpu[i] // cp_size",
        }
        names = {"function": self.function_name, "inverse": self.inverse_name}
        if names[part] is None:
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        # The copies are executed in the new module's own namespace, so the stand-ins for
        # parallel_state and the gather that this module's users set on it are what they read.
        broken = type(self.module)(self.module.__name__ + "_broken")
        vars(broken).update({k: v for k, v in vars(self.module).items() if k != "__name__"})
        for which, name in names.items():
            if name is None:
                continue
            source = inspect.getsource(getattr(self.module, name))
            if which == part:
                line = mutations[part]
                if line not in source:
                    raise UpstreamUnavailable(
                        f"{self.label}: the negative control's line `{line}` is not in this "
                        f"release's {name}; the adapter must learn its new shape"
                    )
                source = source.replace(line, line + " + 1")
            exec(source, vars(broken))  # noqa: S102 (the release's own source, or our mutation)
        return dataclasses.replace(self, module=broken)


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


def parse_spec(spec: str) -> tuple[str, str | None]:
    library, _, version = spec.partition("@")
    if library not in LIBRARIES:
        known = ", ".join([*LIBRARIES, "megatron-core"])
        raise UpstreamUnavailable(f"unknown library {library!r}; known: {known}")
    return library, (None if version in ("", "installed") else version)


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


def load(library: str, version: str | None, target: Target) -> Loaded:
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
    drawn: dict[str, tuple] = {}
    skipped: dict[str, str] = {}
    for param in inspect.signature(getattr(module, name)).parameters:
        if param in FIXED:
            skipped[param] = FIXED[param]
        elif param == "cp_layout" and not _packed_seq_params_has("cp_partition_mode"):
            skipped[param] = (
                "zigzag only: the installed megatron-core's PackedSeqParams has no "
                "cp_partition_mode, and the function refuses 'contiguous' without it"
            )
        elif param == "cp_layout":
            skipped[param] = "zigzag only: the checker's ground truth is the zigzag layout"
        elif param in DRAWN:
            drawn[param] = DRAWN[param]
        else:
            raise UpstreamUnavailable(
                f"{library}@{version} {name} has an option the adapter does not know: {param!r}. "
                "It may change the layout, so the check stops; teach recipe/upstream/adapters.py "
                "what it does (draw it or fix it with a reason)"
            )
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
    return Loaded(
        library,
        version,
        target.name,
        LIBRARIES[library].distribution,
        target.file,
        drawn,
        skipped,
        notes,
        target=target,
        module=module,
        function_name=name,
        inverse_name=inverse,
    )


def _head(values: torch.Tensor, shown: int = 6) -> str:
    listed = [int(v) if float(v).is_integer() else float(v) for v in values.flatten()[:shown]]
    return f"{listed}{' ...' if values.numel() > shown else ''} ({values.numel()} values)"


def _padded_rows(values: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, s] rows holding each sequence at the mask's side, and the bool mask."""
    width = max(v.numel() for v in values) + 2
    rows = torch.zeros(len(values), width, dtype=values[0].dtype)
    mask = torch.zeros(len(values), width, dtype=torch.bool)
    for i, v in enumerate(values):
        where = slice(0, v.numel()) if side == "right" else slice(width - v.numel(), width)
        rows[i, where] = v
        mask[i, where] = True
    return rows, mask


def _nested(tensors: list) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def _label_mask(n: int) -> torch.Tensor:
    return (torch.arange(n) + 1 < n).to(torch.int64)


def _thd_fields(function: Callable, sequences, options: dict) -> dict:
    """verl's engine path: tokens and positions from one call, labels from the same call with
    need_roll=True (as model_forward rolls the label tensor), the loss mask sharded as a
    per-token tensor (1 where a next token exists)."""
    ids = _nested([s.to(torch.int64) for s in sequences])
    tokens, params, positions = function(ids, pre_process=True, need_roll=False, **options)
    labels = function(ids, pre_process=True, need_roll=True, **options)[0]
    masks = _nested([_label_mask(s.numel()) for s in sequences])
    loss_mask = function(masks, pre_process=True, need_roll=False, **options)[0]
    return {
        "input_ids": tokens.reshape(-1),
        "position_ids": positions.reshape(-1),
        "labels": labels.reshape(-1),
        "loss_mask": loss_mask.reshape(-1),
        "cu_seqlens_padded": params.cu_seqlens_q_padded,
    }


def _bshd_fields(function: Callable, sequences, options: dict) -> dict:
    """The packed-BSHD path: [b, s] rows with an attention mask; labels and the loss mask are
    [b, s] tensors sharded by the same function, as verl's and Bridge's forwards do."""
    options = dict(options)
    side = options.pop("mask_side", "right")
    dtype = getattr(torch, options.pop("mask_dtype", "bool"))
    sequences = [s.to(torch.int64) for s in sequences]
    per_token = {
        "input_ids": sequences,
        "labels": [torch.cat([s[1:], s.new_zeros(1)]) for s in sequences],
        "loss_mask": [_label_mask(s.numel()) for s in sequences],
    }
    rows = {k: _padded_rows(v, side)[0] for k, v in per_token.items()}
    mask = _padded_rows(sequences, side)[1].to(dtype)
    sharded = {k: function(v, mask, pre_process=True, **options) for k, v in rows.items()}
    fields = {k: out[0].reshape(-1) for k, out in sharded.items()}
    return {
        **fields,
        "cu_seqlens_padded": sharded["input_ids"][1].cu_seqlens_q_padded,
    }


def _case_text(case: dict) -> str:
    return f"lengths={case['lengths']} cp={case['cp']} tp={case['tp']}"


# The reproducer's call of a zigzag-contract function: every rank played in one process, the
# function reading its rank from a stand-in for megatron's parallel_state, as in the checker.
REPRODUCER_CALL = """
import torch

STUBS = {stubs!r}
FILE = {file!r}
FUNCTION = {function!r}


class ParallelState:
    \"\"\"What the function reads of megatron's parallel_state, for one rank.\"\"\"

    def __init__(self, cp_size, cp_rank, tp_size):
        self.cp_size, self.cp_rank, self.tp_size = cp_size, cp_rank, tp_size

    def get_context_parallel_world_size(self):
        return self.cp_size

    def get_context_parallel_rank(self):
        return self.cp_rank

    def get_tensor_model_parallel_world_size(self):
        return self.tp_size

    def get_context_parallel_group(self):
        return None


def case_sequences():
    \"\"\"The case's sequences, token ids unique over the batch (0 is padding).\"\"\"
    stride = max(CASE["lengths"]) + 1
    return [[1 + stride * i + j for j in range(n)] for i, n in enumerate(CASE["lengths"])]


def release_outputs(wheel):
    \"\"\"Every rank's input_ids, position_ids, labels, loss_mask and cu_seqlens_padded.\"\"\"
    module = load_from_wheel(wheel, FILE, STUBS)
    logger = getattr(module, "logger", None)
    if logger is not None and not hasattr(logger, "warning_once"):
        logger.warning_once = logger.debug  # the package's __init__ (not run) adds it
    function = getattr(module, FUNCTION)
    sequences = [torch.tensor(s) for s in case_sequences()]
    outputs = []
    for rank in range(CASE["cp"]):
        module.mpu = ParallelState(CASE["cp"], rank, CASE["tp"])
        got = fields(function, sequences, dict(OPTIONS))
        outputs.append({{k: v.tolist() for k, v in got.items()}})
    return outputs
"""

# The reproducer's ground truth, written out on its own (it imports nothing of the recipe).
ZIGZAG_PROBLEMS = """
def problems(outputs):
    \"\"\"What differs from zigzag CP: every real token on exactly one rank, rank r holding
    chunks r and 2*cp-1-r of every sequence padded to a multiple of 2*cp, at its own slot, with
    its position, the next token of its own sequence as its label, and loss weight 1 where such a
    label exists; padding never weighted.\"\"\"
    cp = CASE["cp"]
    sequences = case_sequences()
    where = {t: (i, p) for i, s in enumerate(sequences) for p, t in enumerate(s)}
    found, seen = [], {}
    for rank, out in enumerate(outputs):
        for slot, token in enumerate(out["input_ids"]):
            if token not in where:
                if out.get("loss_mask") and out["loss_mask"][slot]:
                    found.append(f"rank {rank} slot {slot}: padding has loss mask 1")
                continue
            seen.setdefault(token, []).append((rank, slot))
            i, p = where[token]
            n = len(sequences[i])
            want = {"position_ids": p, "loss_mask": int(p + 1 < n)}
            if p + 1 < n:
                want["labels"] = sequences[i][p + 1]
            for name, value in want.items():
                if name in out and out[name][slot] != value:
                    found.append(f"rank {rank} slot {slot} (sequence {i}, position {p}): "
                                 f"{name} is {out[name][slot]}, should be {value}")
    cu = outputs[0]["cu_seqlens_padded"]
    for token, (i, p) in where.items():
        places = seen.get(token, [])
        if not places:
            found.append(f"sequence {i} position {p} (token {token}) is on no rank")
            continue
        if len(places) > 1:
            found.append(f"sequence {i} position {p} is on ranks {[r for r, _ in places]}")
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            continue  # reported once per sequence below
        chunk = padded // (2 * cp)
        c = p // chunk
        rank = c if c < cp else 2 * cp - 1 - c
        slot = cu[i] // cp + p - c * chunk + (0 if c < cp else chunk)
        if places[0] != (rank, slot):
            found.append(f"sequence {i} position {p} is at rank {places[0][0]} slot "
                         f"{places[0][1]}, zigzag puts it at rank {rank} slot {slot}")
    for i in range(len(sequences)):
        padded = cu[i + 1] - cu[i]
        if padded % (2 * cp):
            found.append(f"sequence {i} is padded to {padded}, not a multiple of 2*cp={2 * cp}: "
                         "zigzag CP cannot split it into whole chunks")
    return found
"""
