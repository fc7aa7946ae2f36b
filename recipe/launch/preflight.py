"""Every check that needs more than the config, made once, in the process that starts the run.

The schema (`recipe.config`) refuses what the config alone shows. What depends on this machine
(its device and the installed Transformer Engine), on code loaded from outside (your
`cp.preprocess` function, a release's wheel) or on files (the world a launcher started, the
checkpoint `trainer.resume` names) is checked here, before any rank starts or data loads, so a
bad choice is one start-up error naming the field, not a failure in every rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from recipe.checkpoint import read_manifest, resolve_resume, resume_differences
from recipe.config import TrainConfig
from recipe.config.preprocess import FUNCTION, RELEASE, parse_preprocess
from recipe.environment import ProcessEnvironment, launched_world_problem
from recipe.errors import ConfigError
from recipe.megatron.versions import check_te_cp_comm_type, transformer_engine_version
from recipe.model.numerics import check_backend_and_precision, resolve_precision
from recipe.rundir.metrics import holds_metrics, run_id_in


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
    """What the config alone cannot check: choices that depend on this machine's device."""
    from recipe.model.gpt import resolve_attention_backend

    precision = resolve_precision(cfg.trainer.precision, device)
    backend = cfg.model.attention_backend
    if backend == "auto":
        backend = resolve_attention_backend(backend)
    check_backend_and_precision(backend, precision, cuda=device.type == "cuda")
    if backend == "te" and cfg.cp.size > 1:
        check_te_cp_comm_type(cfg.cp.comm_type, transformer_engine_version())
    check_preprocess_function(cfg.cp.preprocess)


def check_preprocess_function(preprocess: str) -> None:
    """A function named by cp.preprocess (your package.module:function, or a released
    LIBRARY@VERSION, fetched here) is loaded and its signature checked before any rank starts:
    a missing module or release, or a function of another shape, is a start-up error naming
    cp.preprocess, not a failure in every rank."""
    from recipe.parallel.cp.contract import load_function
    from recipe.upstream.adapters import checking_preprocess
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
        fn = load_function(preprocess)
    except ValueError as err:
        raise ConfigError(f"cp.preprocess={preprocess}: {err}") from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a readable signature: the first call will tell
    try:
        signature.bind([], None, 2, 0)
    except TypeError as err:
        raise ConfigError(
            f"cp.preprocess={preprocess}: takes {signature}, which cannot be called as "
            f"fn(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1) ({err}); the "
            "contract is in recipe/parallel/cp/contract.py"
        ) from None


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
        check_same_run(cfg.output_dir, checkpoint, manifest.get("run_id"))
    return checkpoint


def check_same_run(output_dir: str | None, checkpoint: Path, checkpoint_run: str | None) -> None:
    """Resuming into a directory that holds another run's metrics would mix two runs in one
    metrics.jsonl (and replace its summary): refused. The runs' ids decide; for runs written
    before ids, a checkpoint from outside this directory counts as another run."""
    if output_dir is None:
        return
    if not holds_metrics(output_dir):
        return  # a new directory gets the checkpoint's records: the run continues there
    here = run_id_in(output_dir)
    inside = Path(output_dir).resolve() in Path(checkpoint).resolve().parents
    same = here == checkpoint_run if here and checkpoint_run else inside
    if not same:
        whose = f"run {here}" if here else "another run"
        raise ConfigError(
            f"run directory {output_dir} holds the metrics of {whose}; checkpoint {checkpoint} "
            f"belongs to {'run ' + checkpoint_run if checkpoint_run else 'another run'}. Resume "
            "into a new hydra.run.dir (the checkpoint's records are copied there) or into the "
            "checkpoint's own run directory"
        )
