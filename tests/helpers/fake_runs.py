"""Run directories written without training, for the comparison tools (`python -m recipe.compare`,
`recipe.compare.diverge`, scripts/compare_runs.py): the files `python train.py` leaves, written by
the recipe's own writers where it has them, with made-up values."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def make_run(
    root: Path,
    name: str,
    cp: int = 1,
    pe: str = "rope",
    steps: int = 5,
    shift: float = 0.0,
    mtp: bool = False,
    drop: tuple[str, ...] = (),
    record_tokens: tuple[int, ...] = (),
    trace_steps: tuple[int, ...] = (),
) -> Path:
    """`root/name`: `.hydra/config.yaml` and `metrics.jsonl` (lm_loss 5/step, moved by
    shift*step; the metrics in `drop` left out), plus per-token records (`tokens/`) of the steps
    in `record_tokens` and traces (`trace/`) of those in `trace_steps`, the same at every cp."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    config = {
        "cp": {"size": cp, "preprocess": "index"},
        "parallel": {"dp": 1, "tp": 1},
        "model": {"position_embedding_type": pe},
        "mtp": {"enabled": mtp},
        "output_dir": str(run),
    }
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "lm_loss": 5.0 / step + shift * step, "grad_norm": 1.0 + 0.1 * step}
        if mtp:
            row["mtp_loss"] = 6.0 / step
        rows.append({k: v for k, v in row.items() if k not in drop})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step in record_tokens:
        _write_tokens(run, step, cp, shift)
    for step in trace_steps:
        _write_trace(run, step, shift)
    return run


def _write_tokens(run: Path, step: int, cp: int, shift: float) -> None:
    """Two samples of 8 tokens, each rank holding its zigzag chunks (chunk r and 2cp-1-r)."""
    import torch

    from recipe.rundir.tokens import write_token_records

    rows = []
    for sample in range(2):
        for position in range(8):
            chunk = position * 2 * cp // 8
            rank = min(chunk, 2 * cp - 1 - chunk)
            loss = 1.0 + 0.1 * position + sample + shift * step
            rows.append([sample, position, loss, 0, rank, chunk])
    write_token_records(run, step, [torch.tensor(rows, dtype=torch.float64)])


def _write_trace(run: Path, step: int, shift: float) -> None:
    """Two modules' outputs on the 16 tokens of _write_tokens, and one parameter's gradient."""
    import torch

    from recipe.rundir.traces import write_trace

    sample = torch.arange(16) // 8
    position = torch.arange(16) % 8
    room = 8 - position
    values = torch.linspace(0.5, 2.0, 16 * 4).reshape(16, 4) + shift
    modules = {
        "embedding": (sample, position, values, room),
        "decoder.final_layernorm": (sample, position, values * 2, room),
    }
    trace = {"order": list(modules), "modules": modules}
    write_trace(run, step, [trace], {"embedding.word_embeddings.weight": values[:4] + shift})
