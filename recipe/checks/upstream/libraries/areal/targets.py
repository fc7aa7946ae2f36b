"""The three checked targets of AReaL's packed CP: the split (tokens and the engine's labels,
against the zigzag contract), the reassembly and postprocess (round trips, against the original
tensor); their negative controls (one line of the release's source slipped) and reproducers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    IMPACTS,
    Checked,
    CheckTarget,
    ContractChecked,
    Finding,
    entry_points,
    function_line,
    script_body,
)
from recipe.checks.upstream.libraries.areal.release import (
    ENGINE,
    FIXED,
    FUNCTIONS,
    PADDING_OPTIONS,
    PCP,
    POSTPROCESS_DRAWN,
    POSTPROCESS_OPTIONS,
    SIGNATURES,
    Release,
    load_release,
)
from recipe.checks.upstream.libraries.areal.shipped_problems import (
    SHIPPED,
    postprocess_problems,
    reassembly_problems,
)
from recipe.checks.upstream.libraries.areal.shipped_run import (
    micro_batch,
    postprocess_outputs,
    reassembly_outputs,
    split_on_rank,
)
from recipe.parallel.cp.contract import global_batch, unique_sequences
from recipe.parallel.cp.zigzag import zigzag_index
from recipe.upstream.source import UpstreamUnavailable


def _case_text(case) -> str:
    return f"lengths={list(case['lengths'])} cp={case['cp']} tp={case['tp']}"


def _worst(problems, case) -> tuple[Impact, str] | None:
    if not problems:
        return None
    impact, what = max(problems, key=lambda p: IMPACTS[p[0]])
    return IMPACTS[impact], f"{_case_text(case)}: {what}"


# The negative controls: one line of the release's own source, with one realistic slip.
MUTATIONS = {
    "preprocess_packed_seqs_context_parallel": {
        # the back chunk starts one row late
        "function": (
            "preprocess_packed_seqs_context_parallel",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1)",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1) + 1",
        ),
        "labels": (
            "split_packed_seqs_for_context_parallel",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1)",
            "remain_start = input_lens[i] - half_seqlen * (cp_rank + 1) + 1",
        ),
    },
    "reassemble_cp_packed_logprobs": {
        # each rank's shard read from one slot early
        "function": (
            "_build_cp_reassemble_indices",
            "src_offset = j * local_len + local_start",
            "src_offset = j * local_len + local_start - 1",
        ),
    },
    "postprocess_packed_seqs_context_parallel": {
        # rank j's chunks taken from the mirror rank's shard
        "function": (
            "postprocess_packed_seqs_context_parallel",
            "o = output_list[j].squeeze(0)",
            "o = output_list[cp_size - 1 - j].squeeze(0)",
        ),
    },
}
# The functions of packed_context_parallel.py a check runs (a broken copy re-executes them all,
# so each finds the mutated one in its namespace).
RUN = (
    "preprocess_packed_seqs_context_parallel",
    "split_packed_seqs_for_context_parallel",
    "_build_cp_reassemble_indices",
    "reassemble_cp_packed_logprobs",
    "postprocess_packed_seqs_context_parallel",
)


@dataclass(frozen=True)
class ArealTarget(CheckTarget):
    name: str
    file: str = PCP
    kind: str = "split"  # split | reassembly | postprocess

    def load(self, library: str, distribution: str, version: str | None) -> Checked:
        release = load_release(distribution, version)
        cls = {
            "split": SplitChecked,
            "reassembly": ReassemblyChecked,
            "postprocess": PostprocessChecked,
        }[self.kind]
        return cls.create(library, distribution, release, self)


class _ArealChecked:
    """What the three targets share: the loaded release, its notes, the broken copy."""

    release: Release
    def_line: int
    function_name: str
    mutated: str | None

    @property
    def line(self) -> int:
        return self.def_line

    @classmethod
    def create(
        cls,
        library,
        distribution,
        release: Release,
        target: ArealTarget,
        mutated: str | None = None,
        line: int | None = None,
    ):
        pcp = release.modules["pcp"]
        lines = release.lines
        drawn = dict(PADDING_OPTIONS)
        if target.kind == "postprocess":
            drawn.update(POSTPROCESS_OPTIONS)
        skipped = {}
        for name in (*FUNCTIONS[target.kind], "pad_mb_list", "pad_packed_tensor_dict"):
            for p in SIGNATURES[name]:
                drawn_here = target.kind == "postprocess" and name == target.name
                if p not in drawn and not (drawn_here and p in POSTPROCESS_DRAWN):
                    skipped[p] = FIXED[p]
        skipped.update(
            {k: FIXED[k] for k in ("is_vision_model", "use_padded_seq", "tree_training")}
        )
        notes = (
            f"padding: the engine's alignment and pad_mb_list call ({ENGINE}:"
            f"{lines['align'][0]}-{lines['pad'][1]}), run from the wheel",
            *cls.NOTES(lines),
        )
        return cls(
            library=library,
            version=release.version,
            name=target.name,
            distribution=distribution,
            file=target.file,
            drawn=drawn,
            skipped=skipped,
            notes=notes,
            release=release,
            def_line=function_line(pcp, target.name) if line is None else line,
            function_name=target.name,
            mutated=mutated,
        )

    def broken_copy(self, part: str = "function"):
        known = MUTATIONS[self.function_name]
        if part not in known:
            raise UpstreamUnavailable(
                f"{self.label} has no part {part!r} to break; known: {', '.join(known)}"
            )
        victim, line, slip = known[part]
        pcp = self.release.modules["pcp"]
        broken = layouts.mutated_copy(pcp, RUN, victim, line, slip, self.label)
        modules = {**self.release.modules, "pcp": broken}
        release = Release(self.version, modules, self.release.statements, self.release.lines)
        target = ArealTarget(self.name, self.file, self.KIND)
        return type(self).create(
            self.library, self.distribution, release, target, mutated=part, line=self.def_line
        )

    def _reproducer(self, finding: Finding, outputs: str, problems: str) -> str:
        entry = entry_points(
            f"wheel_outputs(wheel, ENGINE, {outputs}, CASE, OPTIONS)", f"problem_texts({problems})"
        )
        body = script_body(SHIPPED, {"ENGINE": ENGINE}, entry=entry)
        title = (
            f"{self.library}@{self.version} {self.name} ({self.file}:{self.line}), run as "
            "AReaL's Megatron engine runs it"
        )
        return self.reproducer_script(title, finding, body)


def _finding(case, options, found) -> Finding | None:
    if found is None:
        return None
    impact, what = found
    return Finding(dict(case), tuple(sorted(options.items())), impact, what)


def _case(case) -> dict:
    if isinstance(case, dict):
        return case
    lengths, cp, tp = case
    return {"lengths": list(lengths), "cp": cp, "tp": tp}


@dataclass
class SplitChecked(_ArealChecked, ContractChecked):
    """The tokens and the engine's labels of every rank, against the zigzag contract."""

    KIND = "split"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802 (a per-class constant that needs the engine's lines)
        return (
            f"labels: the engine's roll of the padded stream and split of it ({ENGINE}:"
            f"{lines['roll'][0]}-{lines['roll'][1]}); the tokens' split and the labels' split "
            "checked on every rank (AReaL shards no positions and no loss mask)",
        )

    def contract_function(self, options: dict) -> Callable:
        release = self.release
        cache: dict = {}

        def per_rank(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1):
            key = (tuple(tuple(s.tolist()) for s in sequences), cp_size, tp_size)
            if key not in cache:
                cache.clear()
                values = [s.to(torch.int64) for s in sequences]
                cache[key] = micro_batch(
                    release.modules, release.statements, values, cp_size, tp_size, options
                )[0]
            tokens, labels, layout = split_on_rank(
                release.modules, release.statements, cache[key], cp_size, cp_rank, tp_size
            )
            # The engine's trailing padding sequence sits last on every rank: the contract's
            # layout is the drawn sequences, so this rank's slots of it are left out.
            n = len(sequences)
            local = int(layout[n]) // cp_size
            return {
                "input_ids": tokens[:local],
                "labels": labels[:local],
                "cu_seqlens_padded": layout[: n + 1],
            }

        return per_rank

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(finding, "split_outputs", "split_problems(outputs, CASE)")

    def truth_outputs(self, finding: Finding):
        case = finding.case
        sequences = unique_sequences(case["lengths"])
        batch = global_batch(sequences, case["cp"], case["tp"])
        ranks = []
        for rank in range(case["cp"]):
            index = zigzag_index(batch.cu_seqlens_padded, case["cp"], rank)
            ranks.append({"input_ids": batch.input_ids[index], "labels": batch.labels[index]})
        return {"error": None, "cu": batch.cu_seqlens_padded.tolist(), "ranks": ranks}


@dataclass
class ReassemblyChecked(_ArealChecked, Checked):
    """Every rank's shard gathered back and unpadded as the engine does: the original tensor."""

    KIND = "reassembly"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802
        return (
            "round trip: a per-token tensor sharded by the release's split on every rank, "
            f"gathered and unpadded by the engine's own statements ({ENGINE}:"
            f"{lines['gather'][0]}-{lines['gather'][1]}), the all-gather a stand-in",
        )

    def finding(self, case, options: dict) -> Finding | None:
        case = _case(case)
        outputs = reassembly_outputs(self.release.modules, self.release.statements, case, options)
        return _finding(case, options, _worst(reassembly_problems(outputs, case), case))

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(finding, "reassembly_outputs", "reassembly_problems(outputs, CASE)")

    def truth_outputs(self, finding: Finding):
        seqs = unique_sequences(finding.case["lengths"])
        values = torch.tensor([t for s in seqs for t in s], dtype=torch.float64)
        return {"error": None, "ranks": [values.clone() for _ in range(finding.case["cp"])]}


@dataclass
class PostprocessChecked(_ArealChecked, Checked):
    """postprocess on every rank's shard: the input (not the last stage), the shard (no
    gather) or the whole padded stream (gathered)."""

    KIND = "postprocess"
    release: Release | None = None
    def_line: int = 0
    function_name: str = ""
    mutated: str | None = None

    @staticmethod
    def NOTES(lines):  # noqa: N802
        return (
            "round trip: a [1, T/cp, V] tensor sharded by the release's split on every rank, "
            "gathered back by postprocess (the all-gather a stand-in); the engine itself "
            "passes gather_output = not cp_local, so it gathers only without CP",
        )

    def finding(self, case, options: dict) -> Finding | None:
        case = _case(case)
        outputs = postprocess_outputs(self.release.modules, self.release.statements, case, options)
        return _finding(case, options, _worst(postprocess_problems(outputs, case, options), case))

    def reproducer(self, finding: Finding) -> str:
        return self._reproducer(
            finding, "postprocess_outputs", "postprocess_problems(outputs, CASE, OPTIONS)"
        )

    def truth_outputs(self, finding: Finding):
        case, options = finding.case, dict(finding.options)
        width = options.get("output_width", 3)
        batch = global_batch(unique_sequences(case["lengths"]), case["cp"], case["tp"])
        cu = batch.cu_seqlens_padded
        full = batch.input_ids.to(torch.float64)[:, None] + torch.arange(width) / 4
        ranks = []
        for rank in range(case["cp"]):
            shard = full[zigzag_index(cu, case["cp"], rank)].unsqueeze(0)
            if not options.get("post_process", True):
                out = shard
            elif options.get("gather_output", True) and options.get("pass_cu_seqlens", True):
                out = full
            else:
                out = shard.squeeze(0)
            ranks.append({"input": shard, "output": out.clone()})
        return {"error": None, "cu": cu.tolist(), "ranks": ranks}
