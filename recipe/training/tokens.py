"""Per-token records: every predicted token's loss with its global identity and where it lived.

For the steps in `trainer.record_tokens` each rank lists its predicted tokens as (sample, position,
lm_loss, dp rank, cp rank, chunk, and with mtp=on one mtp_loss_k per depth): `sample` is the
sequence's index within the step (steps hold the same whole sequences in the same order at every
layout), `position` its place in the sequence, derived from the zigzag index, not from
position_ids, so the identity stays right when the preprocessing is wrong. Rank 0 gathers them,
sorts them into global order and writes `<run dir>/tokens/step_NNNNNNNN.npz` (the file is
recipe/rundir/tokens.py's); two runs' records then line up token for token whatever their
layouts (`python -m recipe.compare A B --per-token`).
"""

from __future__ import annotations

import torch

from recipe.parallel.cp.zigzag import local_token_identity
from recipe.rundir.tokens import COLUMNS


def token_columns(mtp_layers: int) -> tuple[str, ...]:
    """COLUMNS, then `mtp_loss_1` ... one per MTP depth: the loss of predicting the token k+1
    ahead from this one, NaN where that token is outside the sequence."""
    return COLUMNS + tuple(f"mtp_loss_{k + 1}" for k in range(mtp_layers))


def token_rows(
    batch,
    per_token_loss: torch.Tensor,
    samples: list[int],
    layout,
    mtp_losses: list[torch.Tensor] = (),
) -> torch.Tensor:
    """[predicted tokens, len(token_columns(len(mtp_losses)))] float64 rows of one micro-batch
    on this rank."""
    sequence, position, chunk = local_token_identity(
        batch.cu_seqlens_padded.cpu(), layout.cp_size, layout.cp_rank
    )
    predicted = batch.loss_mask.cpu() > 0
    sample = torch.tensor(samples, dtype=torch.int64)[sequence]
    n = position.numel()
    rows = torch.stack(
        [
            sample.double(),
            position.double(),
            per_token_loss.detach().double().cpu(),
            torch.full((n,), float(layout.dp_rank), dtype=torch.float64),
            torch.full((n,), float(layout.cp_rank), dtype=torch.float64),
            chunk.double(),
            *(
                torch.where(
                    batch.mtp_mask[k].cpu() > 0,
                    loss.detach().reshape(-1).double().cpu(),
                    torch.tensor(float("nan"), dtype=torch.float64),
                )
                for k, loss in enumerate(mtp_losses)
            ),
        ],
        dim=1,
    )
    return rows[predicted]
