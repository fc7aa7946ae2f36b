"""The checked targets: NeMo Automodel's packer and MTP shift of one release, loaded by path,
their options (drawn, fixed, or a refusal), their negative controls and their reproducers.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

from recipe.checks.assess import Impact
from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import (
    Checked,
    CheckTarget,
    Finding,
    function_line,
)
from recipe.checks.upstream.libraries.nemo_automodel.mtp_truth import (
    call_mtp,
    mtp_problems,
    truth_mtp,
)
from recipe.checks.upstream.libraries.nemo_automodel.packer_truth import (
    FAR_PADDING_ID,
    call_packer,
    pack_problems,
    truth_packs,
)
from recipe.checks.upstream.libraries.nemo_automodel.reproducer import mtp_script, packer_script
from recipe.upstream.releases import partition_options
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

DISTRIBUTION = "nemo-automodel"
PACKER_FILE = "nemo_automodel/components/datasets/llm/packed_sequence.py"
MTP_FILE = "nemo_automodel/components/models/common/mtp/mtp.py"

PACKER_DRAWN = {
    "max_packs": (None, 1, 2, 3),
    "padding_idx": (0, FAR_PADDING_ID),
    "drop_long_samples": (True, False),
    "pad_to_multiple_of": (1, 2, 3, 8),
}
PACKER_INPUT = {"input_form": ("hf_dataset", "list"), "loss_mask": (False, True)}
PACKER_FIXED = {
    "dataset": "the case's documents (input_form: an HF Dataset or a list of dicts)",
    "split": "None: it only picks an entry of a DatasetDict, and the case is a Dataset",
    "packed_sequence_size": "part of the case (drawn with the lengths, aligned to 2*cp or not)",
    "cp_size": "part of the case (1, 2, 4, 8)",
}
MTP_DRAWN = {"num_depths": (1, 2, 3, 4), "ignore_index": (-100, -1)}
MTP_INPUT = {
    "rows": (1, 2),
    "boundaries": ("seq_lens_padded", "cu_seqlens_padded", "seq_idx", "_packed_seq_ids"),
    "positions": ("per_row", "shared", "mrope", "none"),
}
MTP_FIXED = {
    "batch": "the case's packed rows, with the drawn boundary metadata and positions; real "
    "offsets (cu_seqlens) are not drawn: the function refuses them on a padded stream",
}

# The negative controls: (function, the line as released, the line broken).
PACKER_MUTATION = (
    "pack_dataset",
    "cp_padding_amount = cp_padded_len - seq_len",
    "cp_padding_amount = cp_padded_len - seq_len + 1",
)
MTP_MUTATION = (
    "shift_packed_tensor",
    "shifted_seq_idx = torch.roll(seq_idx, shifts=-depth, dims=1)",
    "shifted_seq_idx = torch.roll(seq_idx, shifts=-depth + 1, dims=1)",
)


def check_signature(function, label: str, fixed: dict, drawn: dict) -> None:
    """Every option of the signature is fixed or drawn; another one refuses the check (it may
    change the layout)."""
    partition_options(function, label, __name__, fixed, drawn)


def _lengths(draw, unit: int, min_length: int, max_sequences: int = 12, max_length: int = 400):
    """Lengths as `checks.assess.micro_batches` draws them: 1, below the zigzag unit, k*unit-1,
    k*unit, k*unit+1, or any up to max_length."""
    from hypothesis import strategies as st

    length = st.one_of(
        st.just(1),
        st.integers(1, unit - 1),
        st.tuples(st.integers(1, 6), st.sampled_from([-1, 0, 1])).map(
            lambda kd: max(1, kd[0] * unit + kd[1])
        ),
        st.integers(1, max_length),
    )
    return draw(
        st.lists(length.map(lambda n: max(n, min_length)), min_size=1, max_size=max_sequences)
    )


def _mutated_copy(module: types.ModuleType, label: str, mutation: tuple, calls: tuple):
    """A copy of `module` whose `mutation[0]` has one line changed; the functions in `calls`
    (which call it) are executed in the copy too, so they reach the broken one."""
    name, line, broken_line = mutation
    return layouts.mutated_copy(module, (name, *calls), name, line, broken_line, label)


@dataclass
class _Released(Checked):
    """One function of the release, loaded by path, with the line of its `def` there."""

    module: types.ModuleType | None = None
    function_name: str = ""
    def_line: int = 0
    broken: bool = False

    @property
    def line(self) -> int:
        return self.def_line

    def _finding(self, case: dict, options: dict, problems: list, head: str) -> Finding | None:
        if not problems:
            return None
        impact, what = max(problems, key=lambda p: p[0])  # the first of the worst class
        return Finding(case, tuple(sorted(options.items())), Impact(impact), f"{head}: {what}")


@dataclass
class PackDatasetChecked(_Released):
    def cases(self, min_length: int = 1):
        from hypothesis import strategies as st

        @st.composite
        def draw(draw):
            cp = draw(st.sampled_from([1, 2, 4, 8]))
            unit = 2 * cp if cp > 1 else 2
            lengths = _lengths(draw, unit, min_length)
            raw = draw(
                st.one_of(
                    st.just(max(lengths)),
                    st.integers(1, max(8, 2 * max(lengths))),
                    st.integers(1, sum(lengths) + unit),
                )
            )
            aligned = draw(st.booleans())
            size = -(-raw // unit) * unit if aligned and cp > 1 else raw
            return {"lengths": lengths, "cp": cp, "pack_size": size}

        return draw()

    def finding(self, case, options: dict) -> Finding | None:
        case = dict(case)
        outputs = call_packer(self.module, self.function_name, case, options)
        problems = pack_problems(case, options, outputs)
        head = f"lengths={case['lengths']} cp={case['cp']} pack_size={case['pack_size']}"
        return self._finding(case, options, problems, head)

    def broken_copy(self, part: str = "function") -> PackDatasetChecked:
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        copy = _mutated_copy(self.module, self.label, PACKER_MUTATION, ())
        return PackDatasetChecked(self.library, self.version, self.name, self.distribution,
                                  self.file, self.drawn, self.skipped, self.notes, copy,
                                  self.function_name, self.def_line, True)  # fmt: skip

    def reproducer(self, finding: Finding) -> str:
        title = (
            f"NeMo Automodel {self.version} {self.function_name} ({self.file}:{self.line}) on "
            "one case (the released file imports `datasets`: needs it besides torch)"
        )
        return self.reproducer_script(title, finding, packer_script(self.file, self.function_name))

    def truth_outputs(self, finding: Finding):
        return truth_packs(finding.case, dict(finding.options))


@dataclass
class MTPShiftChecked(_Released):
    def cases(self, min_length: int = 1):
        from hypothesis import strategies as st

        @st.composite
        def draw(draw):
            cp = draw(st.sampled_from([2, 4, 8]))
            return {"lengths": _lengths(draw, 2 * cp, min_length), "cp": cp}

        return draw()

    def finding(self, case, options: dict) -> Finding | None:
        case = dict(case)
        outputs = call_mtp(self.module, self.function_name, case, options)
        problems = mtp_problems(case, options, outputs)
        return self._finding(case, options, problems, f"lengths={case['lengths']} cp={case['cp']}")

    def broken_copy(self, part: str = "function") -> MTPShiftChecked:
        if part != "function":
            raise UpstreamUnavailable(f"{self.label} has no {part} to break")
        copy = _mutated_copy(self.module, self.label, MTP_MUTATION, (self.function_name,))
        return MTPShiftChecked(self.library, self.version, self.name, self.distribution,
                               self.file, self.drawn, self.skipped, self.notes, copy,
                               self.function_name, self.def_line, True)  # fmt: skip

    def reproducer(self, finding: Finding) -> str:
        title = f"NeMo Automodel {self.version} {self.function_name} ({self.file}:{self.line})"
        return self.reproducer_script(title, finding, mtp_script(self.file, self.function_name))

    def truth_outputs(self, finding: Finding):
        return truth_mtp(finding.case, dict(finding.options))


@dataclass(frozen=True)
class _Target(CheckTarget):
    name: str
    file: str
    checked: type
    fixed: dict = field(default_factory=dict)
    drawn: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def load(self, library: str, distribution: str, version: str | None) -> Checked:
        path, version = source_file(distribution, version, self.file)
        tag = f"{library}_{version}_{self.name}".replace(".", "_").replace("-", "_")
        module = load_module(path, f"recipe_upstream_{tag}", {})
        function = getattr(module, self.name, None)
        if not callable(function):
            raise UpstreamUnavailable(f"{library}@{version} has no {self.name} in {self.file}")
        label = f"{library}@{version} {self.name}"
        check_signature(function, label, self.fixed, self.drawn)
        return self.checked(library, version, self.name, distribution, self.file,
                            {**self.drawn, **self.inputs}, dict(self.fixed), self.notes, module,
                            self.name, function_line(module, self.name))  # fmt: skip


PACK_DATASET = _Target(
    "pack_dataset",
    PACKER_FILE,
    PackDatasetChecked,
    PACKER_FIXED,
    PACKER_DRAWN,
    PACKER_INPUT,
    (
        "a packer, not a per-rank function: every real token in one pack, at its position, with "
        "its label; padding labels -100; each document's span a multiple of 2*cp",
    ),
)
MTP_SHIFT = _Target(
    "prepare_mtp_context_parallel_inputs",
    MTP_FILE,
    MTPShiftChecked,
    MTP_FIXED,
    MTP_DRAWN,
    MTP_INPUT,
    (
        "the MTP shift of the unsharded batch: each depth's target the label p + depth of the same "
        "document, never across one, on every rank of the zigzag split",
    ),
)
