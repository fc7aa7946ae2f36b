"""Loss spikes of the default run: how spiky a setting trains, and where a spike comes from.

    python benchmarks/spikes.py sweep "model.init_method_std=0.02" "model.init_method_std=0.1"
    python benchmarks/spikes.py norms model.init_method_std=0.02

`sweep` trains the default (500 steps) once per comma-separated override list and prints, as
JSON lines, the largest lm_loss and grad_norm over the median of the 10 steps before (after step
10) and gap_closed: the figures of docs/stability.md. `norms` trains the first 18 steps and
prints, at every RMSNorm input on a fixed eval batch, the token-mean vector's rms, its share of
the per-token energy, and its cosine across step 16's and step 17's updates (a sign flip shows as
a negative cosine).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUIET = ["trainer.progress_bar=false", "logger.wandb.mode=disabled", "trainer.checkpoint_every=0"]


def _max_ratios(history: list[dict], window: int = 10) -> dict:
    worst = {"lm_loss": (0.0, None), "grad_norm": (0.0, None)}
    for i in range(window, len(history)):
        for key in worst:
            ratio = history[i][key] / statistics.median(h[key] for h in history[i - window : i])
            if ratio > worst[key][0]:
                worst[key] = (ratio, history[i]["step"])
    return worst


def sweep(specs: list[str]) -> None:
    from recipe.launch.compose import compose_typed
    from recipe.launch.rank import train

    for spec in specs:
        overrides = [o for o in spec.split(",") if o]
        start = time.perf_counter()
        result = train(compose_typed([*QUIET, "trainer.loss_spike.factor=0", *overrides]))
        worst = _max_ratios(result["history"])
        print(
            json.dumps(
                {
                    "overrides": overrides,
                    "max_loss_ratio": round(worst["lm_loss"][0], 3),
                    "at_step": worst["lm_loss"][1],
                    "max_grad_norm_ratio": round(worst["grad_norm"][0], 1),
                    "gap_closed": result["summary"]["gap_closed"],
                    "seconds": round(time.perf_counter() - start),
                }
            ),
            flush=True,
        )


def norms(overrides: list[str]) -> None:
    import torch

    from recipe.data.corpus import load_corpus
    from recipe.launch.compose import compose_typed
    from recipe.launch.local import lone_world
    from recipe.training.micro_batch import MicroBatchPass, run_micro_batch
    from recipe.training.trainer import Trainer

    cfg = compose_typed([*QUIET, "trainer.loss_spike.factor=0", *overrides])
    with lone_world(cfg.trainer.seed) as layout:
        trainer = Trainer(cfg, layout, torch.device("cpu"), load_corpus(cfg.data))
        work = trainer.eval_chunks[0]
        batch = work.micro_batches[0]
        micro = MicroBatchPass(work, cfg, layout, trainer.precision, trainer.model, training=False)
        real = batch.loss_mask.bool()
        captured, recording = {}, [False]

        def hook(module, inputs, output, name):
            if recording[0]:
                captured[name] = inputs[0].detach()[:, 0][real].double()

        names = [n for n, m in trainer.model.named_modules() if type(m).__name__ == "RMSNorm"]
        for name, module in trainer.model.named_modules():
            if name in names:
                module.register_forward_hook(lambda m, i, o, n=name: hook(m, i, o, n))

        def snapshot() -> dict:
            trainer.model.eval()
            recording[0] = True
            with torch.no_grad():
                run_micro_batch(micro, 0, trainer.model, backward=False)
            recording[0] = False
            trainer.model.train()
            return {n: v.mean(0) for n, v in captured.items()} | {
                f"{n}:share": float(v.mean(0).pow(2).sum() / v.pow(2).sum(1).mean())
                for n, v in captured.items()
            }

        after = {}
        for step in range(1, 18):
            trainer.train_step()
            if step >= 15:
                after[step] = snapshot()
    cos = torch.nn.functional.cosine_similarity
    for name in names:
        print(
            json.dumps(
                {
                    "norm_input": name,
                    "token_mean_rms_after_17": round(
                        float(after[17][name].pow(2).mean().sqrt()), 4
                    ),
                    "token_mean_share_after_17": round(after[17][f"{name}:share"], 3),
                    "cos_across_step_16": round(
                        float(cos(after[15][name], after[16][name], dim=0)), 3
                    ),
                    "cos_across_step_17": round(
                        float(cos(after[16][name], after[17][name], dim=0)), 3
                    ),
                }
            )
        )


if __name__ == "__main__":
    mode, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if mode == "sweep":
        sweep(rest or ["model.init_method_std=0.02", ""])
    elif mode == "norms":
        norms(rest)
    else:
        sys.exit(__doc__)
