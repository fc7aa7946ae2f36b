"""ms-swift's batch path on one CP rank: its collator, prepare_batch and get_batch_on_this_cp_rank,
every step the release's own code, checked against the zigzag contract (or contiguous CP)."""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    ContractChecked,
    Finding,
    function_line,
)
from recipe.checks.upstream.libraries.ms_swift.batch_reproducer import batch_body
from recipe.checks.upstream.libraries.ms_swift.release import (
    BRIDGE,
    BRIDGE_FILE,
    COLLATOR_FILE,
    IGNORE,
    PAD_ID,
    TRAINER_FILE,
    Strict,
    Swift,
    Target,
    UnknownOption,
    load_swift,
    npu_off,
    settings,
    swapped,
    token_sequences,
)
from recipe.checks.upstream.libraries.ms_swift.truth import (
    case_text,
    contiguous_problem,
    layout_truth_outputs,
    tail_problem,
)
from recipe.upstream.releases import ParallelStateStandIn
from recipe.upstream.source import UpstreamUnavailable

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
class PathBatch:
    """One rank's batch after ms-swift's path, and the row it was split from."""

    batch: dict
    rows: int  # samples side by side without padding_free, else 1
    width: int  # the row's length before the split
    cu_seqlens: torch.Tensor | None  # packed_seq_params.cu_seqlens_q (None without padding_free)


def run_path(swift: Swift, cp_split: Callable, sequences, cp: int, rank: int, tp: int,
              s: dict, unknown: list) -> PathBatch:  # fmt: skip
    """ms-swift's collator and prepare_batch on one rank, `cp_split` as its
    get_batch_on_this_cp_rank."""
    args = Strict(
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
    with npu_off(), swapped(vars(swift.trainer), get_batch_on_this_cp_rank=cp_split):
        batch = swift.trainer.prepare_batch(args, data)
    params = batch.get("packed_seq_params")
    cu = None if params is None else params.cu_seqlens_q.to(torch.int64).cpu()
    return PathBatch(batch, rows, width, cu)


def _template(swift: Swift, s: dict, cp: int, unknown: list):
    """A Template with the attributes the collator reads; any other read is recorded."""
    base = swift.collator.Template

    class Strict(base):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            unknown.append(f"template.{name}")
            raise UnknownOption(f"template.{name}")

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


def _fields(got: PathBatch, s: dict) -> dict[str, torch.Tensor]:
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


def row_layout(got: PathBatch, n: int) -> torch.Tensor:
    """The samples' boundaries in the row(s): cu_seqlens_q up to the last sample (the tail's
    padding segments after it), or one sample per row."""
    if got.cu_seqlens is None:
        return torch.arange(n + 1, dtype=torch.int64) * got.width
    return got.cu_seqlens[: n + 1]


class BatchChecked(ContractChecked):
    """ms-swift's get_batch_on_this_cp_rank on the batch its collator and prepare_batch give
    it: every field one rank trains on, against the zigzag contract (or contiguous CP)."""

    swift: Swift
    cp_split: Callable
    unknown: list

    @classmethod
    def build(cls, library: str, distribution: str, version: str | None, target: Target):
        swift = load_swift(version)
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
                "recipe/checks/upstream/libraries/ms_swift/batch.py what it does"
            )

    def _ranks(self, lengths, cp: int, tp: int, s: dict, sequences=None) -> list[PathBatch]:
        sequences = sequences or token_sequences(lengths)
        return [run_path(self.swift, self.cp_split, sequences, cp, rank, tp, s, self.unknown)
                for rank in range(cp)]  # fmt: skip

    def sequence_parallel(self, options: dict) -> bool:
        return bool(settings(BATCH_DEFAULTS, options)["sequence_parallel"])

    def contract_function(self, options: dict) -> Callable:
        s = settings(BATCH_DEFAULTS, options)

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            tokens = [seq.tolist() for seq in sequences]
            got = run_path(self.swift, self.cp_split, tokens, cp_size, cp_rank, tp_size, s,
                            self.unknown)  # fmt: skip
            cu = row_layout(got, len(tokens))
            fields = _fields(got, s)
            end = int(cu[-1]) // cp_size
            out = {k: (v[:end] if v.numel() >= end else v) for k, v in fields.items()}
            return {**out, "cu_seqlens_padded": cu}

        return per_rank

    def finding(self, case, options: dict) -> Finding | None:
        lengths, cp, tp = case
        s = settings(BATCH_DEFAULTS, options)
        described = case_text(lengths, cp, tp)
        self.unknown.clear()
        sequences = token_sequences(lengths)
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
        cu = row_layout(batches[0], len(lengths))
        if s["cp_partition_mode"] == "contiguous":
            found = contiguous_problem(sequences, fields, cu, batches[0].rows,
                                        batches[0].width, cp)  # fmt: skip
            if found is None:
                return None
            return self._finding(case, options, found[0], f"{described}: {found[1]}")
        if batches[0].cu_seqlens is not None:
            tail = tail_problem(sequences, fields, int(cu[-1]), cp)
            if tail is not None:
                return self._finding(case, options, Impact.MISPLACED, f"{described}: {tail}")
        found = super().finding(case, options)
        self._refuse_unknown()
        return found

    def _finding(self, case, options, impact: Impact, what: str) -> Finding:
        lengths, cp, tp = case
        return Finding({"lengths": list(lengths), "cp": cp, "tp": tp},
                       tuple(sorted(options.items())), impact, what)  # fmt: skip

    def broken_copy(self, part: str = "function") -> BatchChecked:
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
        return self.reproducer_script(
            f"{self.label} ({self.file}:{self.line}) on {BRIDGE} {self.swift.bridge_version}: "
            "what one CP rank trains on after ms-swift's collator and prepare_batch",
            finding,
            batch_body(BATCH_DEFAULTS, self.swift.bridge_version),
        )

    def truth_outputs(self, finding: Finding):
        """Per rank, what each slot should hold: the contract's zigzag (or contiguous) slots of
        the row the release laid out, its own boundaries kept."""
        lengths, cp, tp = finding.case["lengths"], finding.case["cp"], finding.case["tp"]
        s = settings(BATCH_DEFAULTS, dict(finding.options))
        sequences = token_sequences(lengths)
        got = run_path(self.swift, self.swift.split.get_batch_on_this_cp_rank, sequences, cp, 0,
                        tp, s, [])  # fmt: skip
        layout = row_layout(got, len(lengths))
        return layout_truth_outputs(sequences, layout, got.rows, got.width, cp,
                                    s["cp_partition_mode"], not s["is_multimodal"])  # fmt: skip
