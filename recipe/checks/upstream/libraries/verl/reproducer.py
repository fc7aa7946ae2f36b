"""The reproducer of a finding on verl's BSHD engine path, as real code: `reproducer_body`
writes the release's file and stubs, then ships `Collectives`, `bshd_outputs` and `wheel_outputs`
into the standalone script by `inspect.getsource`, then `kit.layouts.REFERENCE` (its
`reference_sequences`, `reference_values` and the ground truth's `reference_problems`) and the
entry points. The kit's prelude before it provides `load_from_wheel` and `ParallelStateStandIn`.
Shipped code is self-contained: torch is imported inside, and the case's tokens and values come
in as arguments.
"""

from __future__ import annotations

from recipe.checks.upstream.kit import layouts
from recipe.checks.upstream.kit.checked import entry_points, script_body
from recipe.checks.upstream.kit.reference import reference_sequences, reference_values
from recipe.upstream.prelude import load_from_wheel
from recipe.upstream.releases import ParallelStateStandIn


class Collectives:
    """torch with all_gather handing back each rank's own tensor of the same name."""

    def __init__(self, torch, per_rank):
        self.torch, self.per_rank, self.rank = torch, per_rank, 0
        self.distributed = self

    def all_gather(self, outputs, tensor, group=None):
        mine = self.per_rank[self.rank]
        name = next(k for k, v in mine.items() if v.data_ptr() == tensor.data_ptr())
        for out, ranks in zip(outputs, self.per_rank):
            out.copy_(ranks[name])

    def __getattr__(self, name):
        return getattr(self.torch, name)


def bshd_outputs(module, case, options, sequences, values):
    """The loaded util.py's preprocess_bshd_engine on every rank of `case` (tokens, labels, loss
    mask, attention mask), then its postprocess_bshd_engine gathering the per-token `values`
    back on every rank: the structure the reference's `problems` judges."""
    import torch

    lengths, cp, tp = case["lengths"], case["cp"], case["tp"]
    width = options.get("output_width")
    kwargs = {}
    if options.get("use_fp8_padding") is not None:
        kwargs["use_fp8_padding"] = options["use_fp8_padding"]
    if options.get("forced_max_seqlen") is not None:  # "longest+K"
        extra = str(options["forced_max_seqlen"]).partition("+")[2]
        kwargs["forced_max_seqlen"] = max(lengths) + int(extra or 0)

    def nested(rows, dtype):
        tensors = [torch.tensor(r, dtype=dtype) for r in rows]
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    ids = nested(sequences, torch.int64)
    loss_mask = nested([[int(p + 1 < n) for p in range(n)] for n in lengths], torch.int64)
    values = nested(values, torch.float64)
    out = {
        "lengths": lengths,
        "cp": cp,
        "layout": "zigzag",
        "width": width,
        "ranks": [],
        "round_trip": [],
        "error": None,
    }
    try:
        shards = []
        for rank in range(cp):
            module.mpu = ParallelStateStandIn(cp, rank, tp)
            shard = module.preprocess_bshd_engine
            tokens, mask, positions = shard(ids, pre_process=True, need_roll=False, **kwargs)
            fields = {
                "input_ids": tokens,
                "position_ids": positions,
                "labels": shard(ids, pre_process=True, need_roll=True, **kwargs)[0],
                "loss_mask": shard(loss_mask, pre_process=True, need_roll=False, **kwargs)[0],
                "attention_mask": mask.int(),
            }
            out["ranks"].append({k: v.reshape(-1).tolist() for k, v in fields.items()})
            output = shard(values, pre_process=True, need_roll=False, **kwargs)[0]
            shards.append({"output": output, "mask": mask})
        rows_width = tokens.shape[1] * cp  # every row is padded to this length
        out["cu_seqlens_padded"] = [rows_width * i for i in range(len(lengths) + 1)]
        module.torch = collectives = Collectives(torch, shards)
        for rank in range(cp):
            module.mpu = ParallelStateStandIn(cp, rank, tp)
            collectives.rank = rank
            back = module.postprocess_bshd_engine(shards[rank]["output"], shards[rank]["mask"])
            out["round_trip"].append([t.tolist() for t in back.unbind()])
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
    return out


def wheel_outputs(wheel, file, stubs, case, options):
    """The release's file loaded from `wheel`, run on the reference's tokens and values."""
    module = load_from_wheel(wheel, file, stubs)
    lengths, width = case["lengths"], options.get("output_width")
    return bshd_outputs(module, case, options, reference_sequences(lengths),
                        reference_values(lengths, width))  # fmt: skip


def reproducer_body(file: str, stubs: dict) -> str:
    """The reproducer's body after the prelude and the case: the release's file and stubs, the
    shipped code, the reference and the entry points."""
    return script_body(
        (Collectives, bshd_outputs, wheel_outputs),
        {"FILE": file, "STUBS": stubs},
        after=layouts.REFERENCE,
        entry=entry_points(
            "wheel_outputs(wheel, FILE, STUBS, CASE, OPTIONS)", "reference_problems(outputs)"
        ),
    )
