"""Turn a global packed micro-batch into one CP rank's micro-batch: the one place CP is applied.

`index` (the recipe's way) selects this rank's tokens from every per-token tensor with one zigzag
index, so positions, labels and masks stay aligned with the tokens by construction. `verl_fixed`
and `verl_legacy` rebuild input_ids and position_ids per sequence with verl's formulas (after and
before PR #6267) as reference variants; labels and the loss mask use the index in all three, so a
difference between them can only come from the positions.
"""

from __future__ import annotations

import torch

from recipe.config.preprocess import INDEX, REFERENCE, parse_preprocess
from recipe.data.packing import PackedBatch
from recipe.errors import RecipeError
from recipe.parallel.cp import contract
from recipe.parallel.cp.contract import LoadedPreprocess
from recipe.parallel.cp.verl import verl_preprocess
from recipe.parallel.cp.zigzag import shard_tensors, zigzag_index


class PreprocessMismatch(RecipeError, RuntimeError):
    """A user's cp.preprocess function differs from the index path on a training micro-batch."""


def shard_batch(
    batch: PackedBatch,
    cp_size: int,
    cp_rank: int,
    method: str = "index",
    tp_size: int = 1,
    check: bool = False,
    loaded: LoadedPreprocess | None = None,
) -> PackedBatch:
    """This rank's part of a global batch; cu_seqlens stay global, as megatron expects.

    `method` may name a function from outside the recipe (a user's `package.module:function`,
    contract.py, or a release's `LIBRARY@VERSION`), handed over `loaded`; its outputs replace the
    index path's for the fields it returns. With `check`, it is first run on every rank of this
    micro-batch and compared with the ground truth.
    """
    if cp_size == 1:
        return batch
    index = zigzag_index(batch.cu_seqlens_padded, cp_size, cp_rank)
    tensors = batch.per_token()
    token_dims = {k: d for k, d in PackedBatch.TOKEN_DIMS.items() if k in tensors}
    local = shard_tensors(tensors, index, token_dims=token_dims)
    kind = parse_preprocess(method).kind
    if kind == INDEX:
        return batch.replace(**local)
    starts = batch.cu_seqlens_padded[:-1].tolist()
    lengths = batch.cu_seqlens.diff().tolist()
    sequences = [batch.input_ids[s : s + n] for s, n in zip(starts, lengths)]
    if kind == REFERENCE:
        input_ids, position_ids = verl_preprocess(
            sequences, batch.cu_seqlens_padded, cp_size, cp_rank, variant=method, tp_size=tp_size
        )
        local["input_ids"], local["position_ids"] = input_ids, position_ids
        return batch.replace(**local)
    if loaded is None:
        raise ValueError(
            f"cp.preprocess={method} names a function from outside the recipe: load it once "
            "(recipe.training.preprocess.load_preprocess) and pass it as `loaded`"
        )
    if check:
        mismatch = contract.check_batch(loaded.check, batch, cp_size, tp_size)
        if mismatch is not None:
            raise PreprocessMismatch(
                f"cp.preprocess={method} differs from the index path on a training micro-batch: "
                f"{mismatch.describe()}. `{loaded.checker}` finds a minimal case; cp.check_steps=0 "
                "skips this check"
            )
    out = contract.call(loaded.train, sequences, batch.cu_seqlens_padded, cp_size, cp_rank, tp_size)
    layout = out.pop(contract.LAYOUT_KEY)
    if not bool(torch.equal(layout, batch.cu_seqlens_padded.to(torch.int64).cpu())):
        raise PreprocessMismatch(
            f"cp.preprocess={method} pads the micro-batch its own way (cu_seqlens_padded "
            f"{layout.tolist()}, the batch has {batch.cu_seqlens_padded.tolist()}); training uses "
            "the batch's boundaries, so set the function's padding options to match them"
        )
    for name, value in out.items():
        local[name] = value.to(local[name].dtype)
    return batch.replace(**local)
