"""One AReaL release loaded from its wheel: its files (with the stubs of imports the run code
never calls), the engine's statements found by their targets, and the check of both against what
the check knows: every argument of a checked signature drawn or fixed (the option tables here),
every name the engine's statements read one the check provides. Anything else refuses the check
(UpstreamUnavailable): it may change the layout."""

from __future__ import annotations

import ast
import functools
import inspect
import logging
from dataclasses import dataclass

from recipe.checks.upstream.libraries.areal.shipped_run import engine_statements, load_modules
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file

PCP = "areal/engine/megatron_utils/packed_context_parallel.py"
ENGINE = "areal/engine/megatron_engine.py"

# The options every target draws: the engine's padding.
PADDING_OPTIONS = {
    "enable_fp8": (False, True),
    "pad_to_maximum": (False, True),
    "max_tokens_per_mb": (None, 256, 1000, 4096),
}
POSTPROCESS_OPTIONS = {
    "post_process": (True, False),
    "gather_output": (True, False),
    "pass_cu_seqlens": (True, False),
    "output_width": (3, 1),
}
# Arguments of the checked signatures, with why they are fixed.
FIXED = {
    "input_ids": "the engine's padded micro-batch (pad_mb_list)",
    "cu_seqlens": "the engine's padded cu_seqlens (pad_mb_list)",
    "tensor": "the engine's rolled padded input_ids (the labels)",
    "local_tensor": "this rank's shard, as the release's split made it",
    "padded_cu_seqlens": "the engine's padded cu_seqlens",
    "mb_list": "one micro-batch, packed as pack_tensor_dict packs it",
    "pad_value": "0.0, as the engine passes it; padding's content is never compared",
    "batch_align_to": "None: the engine does not pass it",
    "data": "pad_mb_list's micro-batch",
    "pad_to_length": "set by pad_mb_list",
    "logits": "the reassembled tensor",
    "padding_length": "pad_mb_list's trailing padding",
    "old_cu_seqlens": "pad_mb_list's unpadded cu_seqlens",
    "output": "this rank's shard as [1, T/cp, V], as megatron's GPTModel returns it",
    "is_vision_model": "False: the engine refuses CP > 1 for vision models",
    "use_padded_seq": "False: the engine refuses CP > 1 for models that need [B, S] input",
    "tree_training": "off: the engine asserts cp_size == 1 with tree training",
    "seq_align_to": "the engine's alignment: 2*cp*tp, lcm with 16 under fp8 (cp, tp, enable_fp8 "
    "drawn)",
}
# The release functions each target runs, whose every argument is drawn or fixed.
FUNCTIONS = {
    "split": ("preprocess_packed_seqs_context_parallel", "split_packed_seqs_for_context_parallel"),
    "reassembly": (
        "preprocess_packed_seqs_context_parallel",
        "reassemble_cp_packed_logprobs",
        "unpad_logits",
    ),
    "postprocess": (
        "preprocess_packed_seqs_context_parallel",
        "postprocess_packed_seqs_context_parallel",
    ),
}
# Arguments of postprocess that its drawn options set.
POSTPROCESS_DRAWN = {"post_process", "gather_output", "cu_seqlens"}
# What each release function is called with (its signature is checked against these).
SIGNATURES = {
    "preprocess_packed_seqs_context_parallel": ("input_ids", "cu_seqlens"),
    "split_packed_seqs_for_context_parallel": ("tensor", "cu_seqlens"),
    "reassemble_cp_packed_logprobs": ("local_tensor", "padded_cu_seqlens"),
    "postprocess_packed_seqs_context_parallel": (
        "output",
        "cu_seqlens",
        "post_process",
        "gather_output",
    ),
    "pad_mb_list": ("mb_list", "pad_value", "pad_to_maximum", "batch_align_to", "seq_align_to"),
    "pad_packed_tensor_dict": ("data", "pad_to_length", "pad_value", "seq_align_to"),
    "unpad_logits": ("logits", "padding_length", "cu_seqlens", "old_cu_seqlens"),
}
# The engine's state its statements may read, by dotted name.
ENGINE_STATE = {"self.enable_fp8", "self.config.pad_to_maximum"}
_QUIET = logging.getLogger("recipe.checks.upstream.libraries.areal.data")
_QUIET.setLevel(logging.ERROR)  # pad_mb_list's "unable to pad to maximum" note, per case


@dataclass(frozen=True)
class Release:
    """One release's files, loaded, and the engine's statements found in it."""

    version: str
    modules: dict
    statements: dict
    lines: dict  # role -> (first, last) line in megatron_engine.py


def _load(distribution: str, version: str | None):
    def load(relative, stubs):
        path, _ = source_file(distribution, version, relative)
        tag = f"{version}_{relative}".replace("/", "_").replace(".", "_").replace("-", "_")
        return load_module(path, f"recipe_upstream_areal_{tag}", stubs)

    return load


@functools.cache
def load_release(distribution: str, version: str | None) -> Release:
    _, version = source_file(distribution, version, PCP)
    modules = load_modules(_load(distribution, version))
    modules["data"].logger = _QUIET
    engine_path, _ = source_file(distribution, version, ENGINE)
    source = engine_path.read_text()
    try:
        statements = engine_statements(source)
    except LookupError as err:
        raise UpstreamUnavailable(
            f"areal@{version} {ENGINE}: {err}; the check runs the engine's own statements and "
            "must learn their new shape"
        ) from None
    _check_names(version, statements)
    for name, params in SIGNATURES.items():
        module = (
            modules["data"]
            if name in ("pad_mb_list", "pad_packed_tensor_dict", "unpad_logits")
            else modules["pcp"]
        )
        fn = getattr(module, name, None)
        if fn is None:
            raise UpstreamUnavailable(f"areal@{version} has no {name}")
        have = tuple(inspect.signature(fn).parameters)
        unknown = [p for p in have if p not in params]
        if unknown:
            raise UpstreamUnavailable(
                f"areal@{version} {name} has an option the check does not know: "
                f"{', '.join(map(repr, unknown))}. It may change the layout, so the check "
                "stops; teach recipe/checks/upstream/libraries/areal/release.py what it does "
                "(draw it or fix it)"
            )
    lines = {role: (s[0][0], s[-1][1]) for role, s in statements.items()}
    return Release(version, modules, statements, lines)


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


# The names each role's statements may read: what the check puts in their namespace.
ROLE_NAMES = {
    "align": {
        "tp_size",
        "cp_size",
        "math",
        "DEFAULT_VECTORIZED_ALIGNMENT_BYTES",
        "self",
        "align_to_multiple_of",
    },
    "pad": {"pad_mb_list", "mb_list", "self", "align_to_multiple_of"},
    "roll": {
        "mb_input",
        "torch",
        "split_packed_seqs_for_context_parallel",
        "padded_cu_seqlens",
        "rolled_ids",
        "cp_labels",
    },
    "gather": {
        "logprobs",
        "reassemble_cp_packed_logprobs",
        "unpad_logits",
        "cp_padded_cu_seqlens",
        "cp_padding_length",
        "cp_old_cu_seqlens",
    },
}
PAD_KEYWORDS = {"pad_value", "pad_to_maximum", "seq_align_to"}


def _check_names(version: str, statements: dict) -> None:
    """Every name and engine attribute the statements read is one the check provides; the
    engine's pad call passes only the keywords the check knows."""
    for role, found in statements.items():
        for line, _end, code in found:
            tree = ast.parse(code)
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            state = {
                d
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and (d := _dotted(n)) and d.startswith("self.")
            }
            state = {d for d in state if not any(o.startswith(d + ".") for o in state)}
            unknown = sorted((names - ROLE_NAMES[role]) | (state - ENGINE_STATE))
            if role == "pad":
                call = tree.body[0].value
                unknown += sorted({k.arg for k in call.keywords} - PAD_KEYWORDS)
                if len(call.args) != 1:
                    unknown.append(f"{len(call.args)} positional arguments")
            if unknown:
                raise UpstreamUnavailable(
                    f"areal@{version} {ENGINE}:{line} `{code}` reads {', '.join(unknown)}, "
                    "which the check does not know; it may change the layout, so the check "
                    "stops (teach recipe/checks/upstream/libraries/areal/release.py what it is)"
                )
