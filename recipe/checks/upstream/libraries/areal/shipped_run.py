"""The release's code run as AReaL's Megatron engine runs it: the engine's statements found and
executed, the release's files loaded, its split, reassembly and postprocess on every rank.

Shipped into reproducers verbatim (`inspect.getsource`, with shipped_problems.py): every function
here is self-contained (imports inside, no module globals but the shipped ones)."""

from __future__ import annotations

from recipe.parallel.cp.contract import unique_sequences
from recipe.upstream.prelude import load_from_wheel, release_text
from recipe.upstream.releases import ParallelStateStandIn

# ---- shipped into reproducers: self-contained (imports inside, no module globals) ----------


def engine_statements(source: str) -> dict:
    """The engine's own statements around the checked functions, by role: [(line, code)].

    align: `_prepare_mb_list`'s assignments of `align_to_multiple_of`; pad: its `mb_list =
    pad_mb_list(...)`; roll: `forward_step`'s padded cu_seqlens, rolled ids and CP labels;
    gather: `_compute_logprobs_and_loss`'s `logprobs = reassemble_cp_packed_logprobs(...)` and
    `logprobs = unpad_logits(...)` (the entropy and vocab statistics repeat the same two)."""
    import ast

    tree = ast.parse(source)
    methods = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def assigned(method, test):
        if method not in methods:
            raise LookupError(f"the engine has no method {method}")
        found = []
        for node in ast.walk(methods[method]):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and test(node.targets[0].id, node.value)
            ):
                found.append(node)
        return sorted(found, key=lambda n: n.lineno)

    def calls(name):
        return lambda target, value: (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == name
        )

    roles = {
        "align": (assigned("_prepare_mb_list", lambda t, v: t == "align_to_multiple_of"), 2),
        "pad": (
            assigned(
                "_prepare_mb_list", lambda t, v: t == "mb_list" and calls("pad_mb_list")(t, v)
            ),
            1,
        ),
        "roll": (
            assigned(
                "forward_backward_batch",
                lambda t, v: t in ("padded_cu_seqlens", "rolled_ids", "cp_labels"),
            ),
            3,
        ),
        "gather": (
            assigned(
                "_compute_logprobs_and_loss",
                lambda t, v: (
                    t == "logprobs"
                    and (
                        calls("reassemble_cp_packed_logprobs")(t, v) or calls("unpad_logits")(t, v)
                    )
                ),
            ),
            2,
        ),
    }
    statements = {}
    for role, (nodes, count) in roles.items():
        if len(nodes) != count:
            raise LookupError(
                f"the engine's {role} statements are {len(nodes)}, the check knows {count}: "
                + "; ".join(f"line {n.lineno}: {ast.unparse(n)}" for n in nodes)
            )
        statements[role] = [(n.lineno, n.end_lineno, ast.unparse(n)) for n in nodes]
    return statements


def run_statements(statements, namespace: dict) -> dict:
    for line, _end, code in statements:
        exec(compile(code, f"<megatron_engine.py:{line}>", "exec"), namespace)  # noqa: S102
    return namespace


class GatherStandIn:
    """torch.distributed (`dist`) and torch.distributed.nn.functional (`dist_F`) as one rank
    sees them: all_gather hands back every rank's shard, this rank's being the one it passes."""

    def __init__(self, shards, rank):
        self.shards, self.rank = list(shards), rank

    def _gathered(self, tensor):
        return [tensor if r == self.rank else s for r, s in enumerate(self.shards)]

    def all_gather(self, *args, group=None):
        if len(args) == 2:  # dist.all_gather(output_list, tensor, group)
            outputs, tensor = args
            for out, shard in zip(outputs, self._gathered(tensor), strict=True):
                out.copy_(shard)
            return None
        return tuple(self._gathered(args[0]))  # dist_F.all_gather(tensor, group)


def load_modules(load) -> dict:
    """The release's files the check runs, each loaded by `load(relative, stubs)`."""
    import logging

    math_module = load("areal/utils/math.py", {})
    constants = load("areal/utils/constants.py", {})
    data = load(
        "areal/utils/data.py",
        {
            "einops": {},
            "torchdata": {},
            "torchdata.stateful_dataloader": {},
            "areal.api.cli_args": {},
            "areal.infra.platforms": {},
            "areal.utils": {"logging": logging},
            "areal.utils.seqpack": {},
            "areal.utils.math": {"align": math_module.align},
        },
    )
    stubs = {"areal.utils.data": {"is_multi_modal_key": data.is_multi_modal_key}}
    pcp = load("areal/engine/megatron_utils/packed_context_parallel.py", stubs)
    return {"pcp": pcp, "data": data, "constants": constants}


def micro_batch(modules, statements, values, cp, tp, options):
    """The engine's padded micro-batch of these per-token tensors (one per sequence):
    (padded_mb, padding_length, old_cu_seqlens), by the engine's own alignment and pad call."""
    import math
    import types

    import torch

    data = modules["data"]
    # the [B, S] batch the engine receives (right-padded rows and their attention mask), packed
    # by the release's pack_tensor_dict as _prepare_mb_list packs each micro-batch
    lengths = [int(v.shape[0]) for v in values]
    rows = torch.zeros(len(values), max(lengths), dtype=values[0].dtype)
    mask = torch.zeros(len(values), max(lengths), dtype=torch.bool)
    for i, v in enumerate(values):
        rows[i, : v.shape[0]] = v
        mask[i, : v.shape[0]] = True
    mb = data.pack_tensor_dict({"input_ids": rows, "attention_mask": mask})
    engine = types.SimpleNamespace(
        enable_fp8=options.get("enable_fp8", False),
        config=types.SimpleNamespace(pad_to_maximum=options.get("pad_to_maximum", False)),
    )
    spec = types.SimpleNamespace(max_tokens_per_mb=options.get("max_tokens_per_mb"))
    namespace = {
        "self": engine,
        "tp_size": tp,
        "cp_size": cp,
        "math": math,
        "DEFAULT_VECTORIZED_ALIGNMENT_BYTES": modules[
            "constants"
        ].DEFAULT_VECTORIZED_ALIGNMENT_BYTES,
        "pad_mb_list": data.pad_mb_list,
        "mb_list": data.MicroBatchList(data={}, mb_spec=spec, mbs=[mb], group_lens=[sum(lengths)]),
    }
    mb_list = run_statements(statements["align"] + statements["pad"], namespace)["mb_list"]
    return mb_list.padded_mbs[0], mb_list.padding_lengths[0], mb_list.old_cu_seqlens_list[0]


def split_on_rank(modules, statements, padded_mb, cp, rank, tp):
    """(tokens, labels, layout) of one rank: the split of the tokens, and the engine's labels
    (its roll of the padded stream and the split of that); layout = the attention's
    cu_seqlens_q_padded."""
    import types

    import torch

    pcp = modules["pcp"]
    pcp.mpu = ParallelStateStandIn(cp, rank, tp)
    tokens, params = pcp.preprocess_packed_seqs_context_parallel(
        padded_mb["input_ids"], padded_mb["cu_seqlens"]
    )
    namespace = {
        "torch": torch,
        "mb_input": types.SimpleNamespace(padded_mb=padded_mb),
        "split_packed_seqs_for_context_parallel": pcp.split_packed_seqs_for_context_parallel,
    }
    labels = run_statements(statements["roll"], namespace)["cp_labels"]
    return tokens.reshape(-1), labels.reshape(-1), params.cu_seqlens_q_padded


def split_outputs(modules, statements, case, options):
    """Every rank's tokens and labels, and the layout, or the error the run raised."""
    import torch

    values = [torch.tensor(s, dtype=torch.int64) for s in unique_sequences(case["lengths"])]
    ranks = []
    try:
        padded_mb = micro_batch(modules, statements, values, case["cp"], case["tp"], options)[0]
        for rank in range(case["cp"]):
            tokens, labels, layout = split_on_rank(
                modules, statements, padded_mb, case["cp"], rank, case["tp"]
            )
            ranks.append({"input_ids": tokens, "labels": labels})
    except Exception as err:  # noqa: BLE001 (a raise on a valid input is what is reported)
        return {"error": f"rank {len(ranks)} raises {type(err).__name__}: {err}"}
    return {"error": None, "cu": [int(c) for c in layout], "ranks": ranks}


def shards_and_stream(modules, statements, case, options):
    """The per-token values of the case (float), the engine's padded micro-batch of them, and
    every rank's shard as the release's split makes it (the model's output layout)."""
    import torch

    pcp = modules["pcp"]
    values = [torch.tensor(s, dtype=torch.float64) for s in unique_sequences(case["lengths"])]
    padded_mb, padding, old_cu = micro_batch(
        modules, statements, values, case["cp"], case["tp"], options
    )
    shards = []
    for rank in range(case["cp"]):
        pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
        shard = pcp.preprocess_packed_seqs_context_parallel(
            padded_mb["input_ids"], padded_mb["cu_seqlens"]
        )[0]
        shards.append(shard.reshape(-1))
    return values, padded_mb, padding, old_cu, shards


def reassembly_outputs(modules, statements, case, options):
    """Every rank's per-token tensor after the engine's reassemble + unpad of the shards."""
    pcp = modules["pcp"]
    got = []
    try:
        _, padded_mb, padding, old_cu, shards = shards_and_stream(
            modules, statements, case, options
        )
        for rank in range(case["cp"]):
            pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
            pcp.dist_F = GatherStandIn(shards, rank)
            namespace = {
                "logprobs": shards[rank],
                "cp_padded_cu_seqlens": padded_mb["cu_seqlens"],
                "cp_padding_length": padding,
                "cp_old_cu_seqlens": old_cu,
                "reassemble_cp_packed_logprobs": pcp.reassemble_cp_packed_logprobs,
                "unpad_logits": modules["data"].unpad_logits,
            }
            got.append(run_statements(statements["gather"], namespace)["logprobs"])
    except Exception as err:  # noqa: BLE001 (as above)
        return {"error": f"rank {len(got)} raises {type(err).__name__}: {err}"}
    return {"error": None, "ranks": got}


def postprocess_outputs(modules, statements, case, options):
    """Every rank's input shard ([1, T/cp, V]) and what postprocess returns for it."""
    import torch

    pcp = modules["pcp"]
    width = options.get("output_width", 3)
    ranks = []
    try:
        _, padded_mb, _, _, shards = shards_and_stream(modules, statements, case, options)
        wide = [(s[:, None] + torch.arange(width) / 4).unsqueeze(0) for s in shards]
        cu = padded_mb["cu_seqlens"] if options.get("pass_cu_seqlens", True) else None
        for rank in range(case["cp"]):
            pcp.mpu = ParallelStateStandIn(case["cp"], rank, case["tp"])
            pcp.dist = GatherStandIn(wide, rank)
            out = pcp.postprocess_packed_seqs_context_parallel(
                wide[rank].clone(),
                cu,
                options.get("post_process", True),
                gather_output=options.get("gather_output", True),
            )
            ranks.append({"input": wide[rank], "output": out})
    except Exception as err:  # noqa: BLE001 (as above)
        return {"error": f"rank {len(ranks)} raises {type(err).__name__}: {err}"}
    return {"error": None, "cu": [int(c) for c in padded_mb["cu_seqlens"]], "ranks": ranks}


def wheel_outputs(wheel, engine_file, run, case, options):
    """A reproducer's `run` (split_outputs, reassembly_outputs or postprocess_outputs) on the
    release in `wheel`: its files loaded, the engine's statements read from `engine_file`."""
    modules = load_modules(lambda relative, stubs: load_from_wheel(wheel, relative, stubs))
    return run(modules, engine_statements(release_text(wheel, engine_file)), case, options)
