"""Every check that needs more than the config, made once, in the process that starts the run.

The schema (`recipe.config`) refuses what the config alone shows. What depends on this machine
(its device, the installed Transformer Engine, wandb and its login), on code loaded from outside
(your `cp.preprocess` function, a release's wheel) or on files (the world a launcher started, the
checkpoint `trainer.resume` names) is checked here, before any rank starts or data loads, so a
bad choice is one start-up error naming the field, not a failure in every rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from recipe.checkpoint import read_manifest, resolve_resume, resume_differences
from recipe.config import TrainConfig, WandbConfig
from recipe.config.preprocess import FUNCTION, RELEASE, parse_preprocess
from recipe.environment import ProcessEnvironment, launched_world_problem
from recipe.errors import ConfigError
from recipe.megatron.versions import check_te_cp_comm_type, transformer_engine_version
from recipe.model.numerics import check_backend_and_precision, resolve_precision
from recipe.rundir.layout import SET_ASIDE_DIR
from recipe.rundir.metrics import holds_metrics, read_metrics


@dataclass(frozen=True)
class Preflight:
    """What the start-up check resolved, handed to the ranks it starts (which check no more)."""

    checkpoint: Path | None
    """The checkpoint trainer.resume names, verified against this config; None: start fresh."""


def preflight(cfg: TrainConfig, device: torch.device) -> Preflight:
    """Every check of this module that a run in this process needs, for a caller that starts
    training itself (a script, a test); the Hydra task makes them one by one, as it goes."""
    check_run_choices(cfg, device)
    return Preflight(checkpoint=check_resumable(cfg))


def check_run_choices(cfg: TrainConfig, device: torch.device) -> None:
    """What the config alone cannot check: choices that depend on this machine's device, the
    function cp.preprocess names, wandb's login."""
    from recipe.model.gpt import resolve_attention_backend

    precision = resolve_precision(cfg.trainer.precision, device)
    backend = cfg.model.attention_backend
    if backend == "auto":
        backend = resolve_attention_backend(backend)
    check_backend_and_precision(backend, precision, cuda=device.type == "cuda")
    if backend == "te" and cfg.cp.size > 1:
        check_te_cp_comm_type(cfg.cp.comm_type, transformer_engine_version())
    check_preprocess_function(cfg.cp.preprocess)
    check_wandb(cfg.logger.wandb)


def check_preprocess_function(preprocess: str) -> None:
    """A function named by cp.preprocess (your package.module:function, or a released
    LIBRARY@VERSION, fetched here) is loaded and its signature checked before any rank starts:
    a missing module or release, or a function of another shape, is a start-up error naming
    cp.preprocess, not a failure in every rank."""
    from recipe.parallel.cp.contract import load_function
    from recipe.upstream.releases import checking_preprocess
    from recipe.upstream.source import UpstreamUnavailable

    kind = parse_preprocess(preprocess).kind
    if kind == RELEASE:
        try:
            checking_preprocess(preprocess)
        except UpstreamUnavailable as err:
            raise ConfigError(f"cp.preprocess={preprocess}: {err}") from None
        return
    if kind != FUNCTION:
        return  # a built-in
    try:
        load_function(preprocess)  # imports it and checks its signature
    except ValueError as err:
        raise ConfigError(f"cp.preprocess={preprocess}: {err}") from None


def check_wandb(wandb_cfg: WandbConfig) -> None:
    """wandb is imported, and online mode logs in, only when the logger starts, after the model is
    built: a missing package or API key is refused here instead, naming the fix."""
    from importlib.util import find_spec

    mode = wandb_cfg.mode
    if mode == "disabled":
        return
    if find_spec("wandb") is None:
        raise ConfigError(
            f"logger.wandb.mode={mode} needs wandb, which is not installed: pip install wandb, "
            "or run without it: logger.wandb.mode=disabled"
        )
    if mode == "online" and not wandb_logged_in():
        raise ConfigError(
            "logger.wandb.mode=online needs a wandb API key and none was found (neither "
            "WANDB_API_KEY nor an entry in ~/.netrc); run `wandb login` or set WANDB_API_KEY, or "
            "log to files with logger.wandb.mode=offline (`wandb sync` them later)"
        )


def wandb_logged_in() -> bool:
    """Whether wandb.init() will find credentials, looked up by wandb's own code as init does
    (WANDB_API_KEY or an identity token file, the netrc entry of the host, wandb's settings)
    without prompting and without contacting the server. An unreadable key is a ConfigError."""
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk.lib.wbauth import authenticate_session
    except ImportError:  # another wandb release: its own login at init tells
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        found = authenticate_session(
            host=host, source="start-up check", prompt=False, update_session=False
        )
    except AuthenticationError as err:
        raise ConfigError(
            f"logger.wandb.mode=online: the wandb credentials cannot be used ({err}); correct "
            "or unset WANDB_API_KEY, or `wandb login --relogin`, or use logger.wandb.mode=offline"
        ) from None
    return found is not None


def check_launched_world(cfg: TrainConfig, env: ProcessEnvironment) -> None:
    """A launcher's world (torchrun, an sbatch allocation, a submitit job) that is not tp*cp*dp
    is refused before any rendezvous, with the launch that would fit."""
    dims = cfg.parallel_dims
    problem = launched_world_problem(env, dims.tp, dims.cp, dims.dp, dims.pp)
    if problem:
        raise ConfigError(problem)


def check_resumable(cfg: TrainConfig) -> Path | None:
    """Before any rank starts: the checkpoint trainer.resume names exists, fits this config, and
    belongs to the run whose metrics this run directory holds (if it holds any). Returns it
    (None: start fresh), for the ranks to resume."""
    checkpoint = resolve_resume(cfg.trainer.resume, cfg.output_dir)
    if checkpoint is not None:
        manifest = read_manifest(checkpoint)
        resume_differences(manifest, cfg)
        check_same_run(cfg.output_dir, checkpoint, manifest)
    return checkpoint


def check_same_run(output_dir: str | None, checkpoint: Path, manifest: dict) -> None:
    """Resuming into a directory that holds metrics continues the run those metrics record: the
    directory's records up to the checkpoint's step must be the checkpoint's own history, or
    the two timelines would mix in one metrics.jsonl (a fork resumed back into its parent's
    directory shares the parent's run id, so ids alone cannot tell). A set-aside checkpoint
    belongs to an abandoned timeline: it resumes only into a new directory."""
    if output_dir is None or not holds_metrics(output_dir):
        return  # a new directory gets the checkpoint's records: the run continues there
    new_dir = "Resume into a new hydra.run.dir (the checkpoint's records are copied there)"
    if SET_ASIDE_DIR in Path(checkpoint).resolve().parent.parts:
        raise ConfigError(
            f"checkpoint {checkpoint} was set aside (a later step of an abandoned timeline); "
            f"run directory {output_dir} records another timeline. {new_dir}"
        )
    step = manifest.get("step")
    here = [r for r in read_metrics(output_dir) if r.get("step", 0) <= step]
    differs = first_difference(here, manifest.get("history") or [])
    if differs is not None:
        raise ConfigError(
            f"run directory {output_dir} records another timeline than checkpoint {checkpoint} "
            f"(step {step}): {differs}. {new_dir}, or into the run directory whose records it "
            "continues"
        )


def first_difference(here: list[dict], history: list[dict]) -> str | None:
    """Where a directory's records and a checkpoint's history part, or None if they agree."""
    for mine, theirs in zip(here, history):
        if json.dumps(mine, sort_keys=True) != json.dumps(theirs, sort_keys=True):
            # the field that differs, not always lm_loss: a fork's first step after the change
            # can log the same loss (its new setting acts from the update on)
            field = next(k for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k))
            return (
                f"the records of step {theirs.get('step')} differ first in {field} "
                f"({_shown(mine, field)} there, {_shown(theirs, field)} in the checkpoint)"
            )
    if len(here) != len(history):
        return (
            f"the directory records {len(here)} steps up to that step, the checkpoint "
            f"{len(history)}"
        )
    return None


def _shown(record: dict, field: str) -> str:
    return json.dumps(record[field]) if field in record else "absent"
