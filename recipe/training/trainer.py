"""The training loop: one optimizer step = the same global tokens whatever the parallel layout.

`Trainer.train -> train_step -> forward_backward_step`, in torchtitan's shape. Each step's whole
sequences are planned for this rank (`step.plan_step`), run forward and backward micro-batch by
micro-batch with per-token loss sums divided by the step's GLOBAL count of predicted tokens, and
the gradients summed over data-parallel x context-parallel ranks: the update is exactly the cp=1,
dp=1 update. The Trainer holds model, optimizer, data stream and step counter, and its
`state_dict()` is everything a resumed run needs to continue bit for bit.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path

import torch

from recipe.checkpoint import (
    checkpoint_manifest,
    full_state,
    load_full_state,
    read_manifest,
    read_tensors,
    resume_differences,
    save_checkpoint,
)
from recipe.config import TrainConfig
from recipe.config.layout import ParallelLayout
from recipe.data.batching import StepStream, chunk_for_eval
from recipe.data.corpus import Corpus
from recipe.data.fingerprint import data_fingerprint
from recipe.data.thd import aligned_length
from recipe.errors import StepRefused
from recipe.log import get_logger
from recipe.model.gpt import whole_model_names
from recipe.model.mtp import MTPBackwardScales
from recipe.model.numerics import (
    resolve_precision,
)
from recipe.parallel import collectives, groups
from recipe.rundir.layout import anchors_dir, checkpoints_dir
from recipe.rundir.tokens import write_token_records
from recipe.rundir.traces import write_trace
from recipe.training.engines import build_engine, engine_class
from recipe.training.guard import StepGuard
from recipe.training.loggers import NullLogger
from recipe.training.metrics import StepMetrics, mtp_layer_means, optimised_loss, summarize
from recipe.training.micro_batch import MicroBatchPass
from recipe.training.mutants import active_mutant, wrap_reduction
from recipe.training.preemption import Preempted, StopRequests
from recipe.training.step import StepWork, plan_step
from recipe.training.throughput import (
    device_peak_tflops,
    linear_parameter_count,
    model_flops_per_step,
)
from recipe.training.tokens import token_columns
from recipe.training.trace import ActivationTrace, gradients_of

_log = get_logger(__name__)


class NonFiniteStep(StepRefused):
    """A step's loss or gradient norm was NaN/inf (trainer.on_nonfinite=stop)."""


class LossSpike(StepRefused):
    """A step's lm_loss or gradient norm spiked (trainer.loss_spike.action=stop)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than trainer.collective_timeout_s for the other ranks."""


class Trainer:
    """Model, optimizer, data stream and step counter of one run on this rank."""

    def __init__(
        self,
        cfg: TrainConfig,
        layout: ParallelLayout,
        device: torch.device,
        corpus: Corpus,
        logger=None,
    ):
        self.cfg = cfg
        self.layout = layout
        self.device = device
        self.precision = resolve_precision(cfg.trainer.precision, device)
        """fp32 or bf16 (autocast around every forward), resolved for this device."""
        self.corpus = corpus
        self.mtp_scales = MTPBackwardScales()
        """The MTP backward scales of this run's micro-batches (mtp.scaling)."""
        self.model = build_model(cfg, corpus.vocab_size, device, layout.cp_rank)
        """This rank's model (its pipeline stage at parallel.pp > 1), unwrapped."""
        self.engine = build_engine(self.model, cfg, layout)
        """What steps the optimizer (trainer.engine)."""
        self.linear_params = linear_parameter_count(self.model)
        self.attention_layers = cfg.model.num_layers + (
            cfg.mtp.num_layers if cfg.mtp.enabled else 0
        )
        self.peak_tflops = device_peak_tflops(device, self.precision, cfg.trainer.peak_tflops)
        self.grad_group = groups.gradient_group()
        self.tp_group = groups.tp_group()
        self.steps = StepStream(corpus.train, cfg.batching.tokens_per_step, cfg.data.seed)
        self.eval_chunks = [
            self._plan(chunk) for chunk in chunk_for_eval(corpus.eval, cfg.batching.tokens_per_step)
        ]
        self.logger = logger or NullLogger()
        self.step = 0
        """Optimizer steps taken."""
        self.history: list[dict] = []
        """metrics.jsonl records of the steps taken."""
        self.checkpoint_dir = checkpoints_dir(cfg.output_dir) if cfg.output_dir else None
        self.whole_names = whole_model_names(self.model) if layout.pp_size > 1 else None
        """At parallel.pp > 1, each parameter's name in the whole model (checkpoints)."""
        # the run's identity: new for a fresh run, the checkpoint's when resumed
        self.run_id = uuid.uuid4().hex[:16]
        # the input files as this run read them, recorded in every checkpoint's manifest (which
        # only the main rank writes: the others do not hash the data)
        self.inputs = data_fingerprint(cfg.data) if self.checkpoint_dir and layout.is_main else {}
        self.guard = StepGuard.from_config(cfg.trainer)
        """Judges each step before its update (non-finite values, spikes)."""
        self.stop_reason: str | None = None
        """Set by a step the guard stops the run at, once that step is logged."""
        self.token_dir = cfg.output_dir
        """Where `trainer.record_tokens` steps write their per-token records."""
        self.record_steps = set(cfg.trainer.record_tokens)
        self.anchor_points: list[int] = []
        """Steps whose state this run keeps for the anchored check (compare.anchor_every)."""
        self.anchor_dir = None
        if cfg.output_dir:
            c = cfg.compare
            self.anchor_points = anchor_points(
                cfg.trainer.max_steps, c.anchor_every, c.anchor_steps
            )
            self.anchor_dir = anchors_dir(cfg.output_dir)
        self.anchor_record_steps = {
            a + k for a in self.anchor_points for k in range(1, cfg.compare.anchor_steps + 1)
        }

    def _plan(
        self, sequences: list[list[int]], check_preprocess: bool = False, mutant=None
    ) -> StepWork:
        return plan_step(
            sequences,
            self.cfg,
            self.layout,
            self.corpus.tokenizer.pad_id,
            self.device,
            check_preprocess,
            self.corpus.image_token_id,
            mutant,
        )

    def _token_dirs(self, step: int) -> list:
        """Where step `step`'s per-token records go: the run's records (trainer.record_tokens)
        and its anchors' (the steps after each anchor)."""
        dirs = [self.token_dir] if step in self.record_steps else []
        if step in self.anchor_record_steps:
            dirs.append(self.anchor_dir)
        return dirs

    def train(self) -> dict:
        """Train up to trainer.max_steps; returns {"summary": ..., "history": [records]}."""
        loop_start = time.perf_counter()
        with StopRequests() as stop:
            while self.step < self.cfg.trainer.max_steps:
                record = self.train_step().to_record()
                self.history.append(record)
                self.logger.log_step(record)
                if self.stop_reason is not None:
                    refused = NonFiniteStep if record.get("nonfinite") else LossSpike
                    raise refused(self.stop_reason)
                if record.get("spike"):
                    what = "not applied" if record.get("skipped") else "applied"
                    action = self.cfg.trainer.loss_spike.action
                    found = self.guard.describe(record["spike"], record)
                    _log.warning(
                        f"step {self.step}: spike: {found}; the step "
                        f"was {what} (trainer.loss_spike.action={action})",
                        rank_zero_only=True,
                    )
                with self._collectives_in("the end-of-step signal check"):
                    signum = collectives.max_over_ranks(stop.signum, self.device)
                if self.step in self.anchor_points:
                    self.save_anchor()
                checkpoint = None
                if signum or self._checkpoint_due():
                    checkpoint = self.save_checkpoint()
                if signum:
                    raise Preempted(signum, self.step, checkpoint)
        summary = summarize(
            self.history,
            entropy_floor=self.corpus.entropy_floor,
            baseline_loss=self.corpus.baseline_loss,
            wall_time_s=time.perf_counter() - loop_start,
        )
        self.logger.log_summary(summary)
        return {"summary": summary, "history": self.history}

    @property
    def optimizer(self):
        """The engine's optimizer (torch's AdamW, or megatron's)."""
        return self.engine.optimizer

    def train_step(self) -> StepMetrics:
        """One optimizer step on the next step of data (and an eval when one is due)."""
        step_start = time.perf_counter()
        self.step += 1
        mutant = active_mutant(self.cfg, self.step)
        if mutant is not None and mutant.weights is not None:
            mutant.weights(self.model)
        work = self._plan(next(self.steps), self.step <= self.cfg.cp.check_steps, mutant)
        lr = self.engine.begin_step(self.step)
        mtp_counts = work.global_mtp_tokens
        token_dirs = self._token_dirs(self.step)
        token_rows_of_step = [] if token_dirs else None
        trace = None
        if self.step in self.cfg.trainer.trace_steps:
            trace = ActivationTrace(self.model, self.layout)
        undo = lambda: None  # noqa: E731
        if mutant is not None and mutant.unreduced is not None:
            undo = wrap_reduction(self.engine, self.model, mutant, work)
        try:
            with self._collectives_in("the forward/backward pass (CP, TP, PP and MTP exchanges)"):
                totals = self.forward_backward_step(work, token_rows_of_step, trace, mutant)
            for directory in token_dirs:
                self._write_token_records(token_rows_of_step, directory)
            with self._collectives_in("the gradient all-reduce"):
                self.engine.reduce_gradients()
        finally:
            undo()
        if trace is not None:  # gradients summed over ranks, before clipping scales them
            self._write_trace(trace.close())
        with self._collectives_in("the gradient all-reduce"):
            norm = self.engine.gradient_norm()
        with self._collectives_in("the loss all-reduce"):
            totals = self._reduce(totals, work)
        lm_loss = totals[0][0] / work.global_predicted_tokens
        mtp_sums = [s for s, _ in totals[1:]]
        loss = optimised_loss(lm_loss, mtp_sums, mtp_counts, self.cfg.mtp.loss_scaling_factor)
        # Every rank reduced the same values, so every rank takes the same decision.
        # In the record's order, so a non-finite step is described as its record lists it.
        judged = {"lm_loss": lm_loss, "loss": loss, "grad_norm": norm}
        verdict = self.guard.judge(self.step, judged)
        if verdict.take_step:
            with self._collectives_in("the optimizer step"):
                self.engine.apply()
        self.stop_reason = verdict.stop
        step_time = time.perf_counter() - step_start
        world = self.layout.world_size
        mfu = None
        if self.peak_tflops:
            flops = model_flops_per_step(
                work.lengths, self.linear_params, self.cfg.model.hidden_size, self.attention_layers
            )
            mfu = flops / step_time / (world * self.peak_tflops * 1e12)
        metrics = StepMetrics(
            step=self.step,
            lm_loss=lm_loss,
            loss=loss,
            mtp_layer_losses=mtp_layer_means(mtp_sums, mtp_counts),
            grad_norm=norm,
            lr=lr,
            tokens=work.global_real_tokens,
            padded_tokens=work.global_padded_tokens,
            micro_batches=work.global_micro_batches,
            step_time_s=step_time,
            tokens_per_s=work.global_real_tokens / step_time,
            tokens_per_s_per_device=(
                work.global_real_tokens / step_time / world if self.device.type == "cuda" else None
            ),
            mfu=mfu,
            spike=verdict.spike,
            skipped=bool(verdict.spike) and not verdict.take_step,
        )
        every = self.cfg.trainer.eval_every
        if self.step == self.cfg.trainer.max_steps or (every and self.step % every == 0):
            metrics.eval_lm_loss = self.evaluate()
        return metrics

    @contextlib.contextmanager
    def _collectives_in(self, phase: str):
        """Name the step, phase and rank when a collective times out: gloo's own message says
        only which buffer it waited for."""
        try:
            yield
        except RuntimeError as err:
            if "timed out" not in str(err).lower():
                raise
            timeout = self.cfg.trainer.collective_timeout_s
            raise CollectiveTimeout(
                f"rank {self.layout.rank} waited more than {timeout:g} s for the other ranks in "
                f"{phase} of step {self.step}: a rank stalled or died "
                f"(trainer.collective_timeout_s={timeout:g}). gloo: {str(err).splitlines()[0]}"
            ) from None

    def forward_backward_step(
        self, work: StepWork, token_rows_out: list | None = None, trace=None, mutant=None
    ):
        """Forward and backward over this rank's micro-batches on the run's engine; returns the
        step's report totals on this rank, [name, (sum, count)] in `work.report_names` order, on
        the device (zeros on pipeline stages without the loss). With `token_rows_out`, each
        micro-batch's per-token records are appended to it."""
        micro = MicroBatchPass(
            work,
            self.cfg,
            self.layout,
            self.precision,
            self.model,
            gradient_divisor=self.engine.gradient_divisor(work),
            token_rows_out=token_rows_out,
            trace=trace,
            mtp_scales=self.mtp_scales,
            mutant=mutant,
        )
        return self.engine.forward_backward(micro)

    def _reduce(self, totals: torch.Tensor, work: StepWork) -> list[tuple[float, float]]:
        """One all-reduce for the whole step's reports, then a check that every predicted token
        was counted exactly once across ranks (a sharding bug that drops or duplicates a token
        would otherwise only nudge the loss)."""
        collectives.all_reduce_sum(totals, self.grad_group)
        pipeline_sum(totals, self.layout)
        pairs = [(s, n) for s, n in totals.tolist()]
        counted = [n for _, n in pairs]
        if counted != [float(c) for c in work.expected_counts]:
            raise RuntimeError(
                f"step {self.step}: ranks counted {counted} predicted tokens per loss "
                f"{work.report_names}, the plan says {work.expected_counts}"
            )
        return pairs

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss on the held-out set (no MTP, no gradients)."""
        self.engine.train(False)
        totals = torch.zeros(1, 2, dtype=torch.float64, device=self.device)
        for work in self.eval_chunks:
            micro = MicroBatchPass(
                work, self.cfg, self.layout, self.precision, self.model, training=False
            )
            totals += self.engine.forward_backward(micro, training=False)
        self.engine.train(True)
        collectives.all_reduce_sum(totals, self.grad_group)
        pipeline_sum(totals, self.layout)
        expected = sum(w.global_predicted_tokens for w in self.eval_chunks)
        loss_sum, counted = totals[0].tolist()
        if counted != expected:
            raise RuntimeError(
                f"eval: ranks counted {counted} predicted tokens, expected {expected}"
            )
        return loss_sum / expected

    def _write_token_records(self, rows: list[torch.Tensor], directory) -> None:
        names = token_columns(self.cfg.mtp.num_layers if self.cfg.mtp.enabled else 0)
        mine = torch.cat(rows) if rows else torch.zeros(0, len(names), dtype=torch.float64)
        with self._collectives_in("the per-token record gather"):
            parts = collectives.gather_to_main(mine)
        if self.layout.is_main and directory:
            write_token_records(directory, self.step, parts, names)

    def _write_trace(self, mine: dict) -> None:
        with self._collectives_in("the trace gather"):
            traces = collectives.gather_to_main(mine)
        if self.layout.is_main and self.cfg.output_dir:
            write_trace(self.cfg.output_dir, self.step, traces, gradients_of(self.model))

    def _checkpoint_due(self) -> bool:
        every = self.cfg.trainer.checkpoint_every
        if not every or self.checkpoint_dir is None:
            return False
        return self.step % every == 0 or self.step == self.cfg.trainer.max_steps

    def checkpoint(self) -> tuple[dict, dict]:
        """This step's resumable state as a checkpoint holds it (every rank takes part): the
        tensors (weights, optimizer moments, RNG state; full tp=1 copies on the CPU, which
        later steps leave as they are) and the manifest (run, step, data position, history,
        layout, config). The recipe draws no random numbers while training: no dropout,
        seeded data order."""
        with self._collectives_in("the checkpoint's tensor-parallel gather"):
            tensors = full_state(
                self.model, self.engine.optimizer_state(), self.tp_group, self.whole_names
            )
        manifest = checkpoint_manifest(
            self.cfg,
            self.layout,
            run_id=self.run_id,
            step=self.step,
            data=self.steps.state_dict(),
            history=list(self.history),
            inputs=self.inputs,
        )
        return tensors, manifest

    def save_checkpoint(self) -> Path | None:
        """Write this step's checkpoint (every rank takes part); None when the run has no
        output directory to write it to."""
        if self.checkpoint_dir is None:
            return None
        tensors, manifest = self.checkpoint()
        return save_checkpoint(
            self.checkpoint_dir,
            self.step,
            tensors,
            manifest,
            self.layout.is_main,
            self.cfg.trainer.checkpoint_keep,
        )

    def save_anchor(self) -> Path:
        """Keep this step's state as an anchor (every rank takes part): a checkpoint in
        <run dir>/anchors/, never pruned, which a run judged against this one starts from."""
        tensors, manifest = self.checkpoint()
        return save_checkpoint(
            self.anchor_dir, self.step, tensors, manifest, self.layout.is_main, keep=2**31
        )

    def start_from(self, checkpoint: Path) -> None:
        """Take over another run's state at a step (an anchor of the baseline, written at any
        layout) whatever its settings: the anchored check trains this run's settings from it."""
        self._resume(read_tensors(checkpoint), read_manifest(checkpoint), f"anchor {checkpoint}")

    def restore(self, checkpoint: Path) -> list[str]:
        """Continue from a checkpoint written at any layout; returns the allowed settings that
        changed since (`key: old -> new`)."""
        manifest = read_manifest(checkpoint)
        changes = resume_differences(manifest, self.cfg)
        self._resume(read_tensors(checkpoint), manifest, f"checkpoint {checkpoint}")
        return changes

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as a checkpoint writes it: {"tensors": weights,
        optimizer moments and RNG state, "manifest": run, step, data position, history, ...}
        (see `checkpoint`)."""
        tensors, manifest = self.checkpoint()
        return {"tensors": tensors, "manifest": manifest}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()` (of a trainer at any layout), as from a checkpoint."""
        tensors = {key: value.clone() for key, value in state["tensors"].items()}  # not shared
        self._resume(tensors, state["manifest"], "the state dict")

    def _resume(self, tensors: dict, manifest: dict, source: str) -> None:
        """Take over a checkpoint's state: full tensors and manifest (`source` names them)."""
        moments = load_full_state(
            tensors, self.model, self.layout.tp_rank, self.layout.tp_size, self.whole_names, source
        )
        with self._collectives_in("the optimizer state's exchange"):
            self.engine.load_optimizer_state(moments)
        self.steps.load_state_dict(manifest["data"])
        self.run_id = manifest.get("run_id", self.run_id)
        self.step = int(manifest["step"])
        self.history = list(manifest["history"])
        self.guard.rebuild(self.history)


def anchor_points(max_steps: int, every: int, steps: int) -> list[int]:
    """The anchors of a run of `max_steps` steps: every `every` steps and the last one from
    which `steps` steps still fit, for runs longer than `every` (0: none)."""
    if not every or max_steps <= every:
        return []
    points = {a for a in range(every, max_steps - steps + 1, every)}
    points.add(max_steps - steps)
    return sorted(p for p in points if p >= 1)


def pipeline_sum(totals: torch.Tensor, layout) -> torch.Tensor:
    """Only the last pipeline stage computes losses: after the dp x cp sum, every stage gets its
    totals (one all-reduce over the pipeline group; nothing at pp=1)."""
    if layout.pp_size > 1:
        collectives.all_reduce_sum(totals, groups.pipeline_group())
    return totals


def build_model(
    cfg: TrainConfig, vocab_size: int, device: torch.device | None = None, cp_rank: int = 0
):
    """The run's model, the same initial weights on every rank; `cp_rank` tells a vision model
    which tokens are its own (for the negative-control position deliveries)."""
    from recipe.model.gpt import build_gpt_model

    vision = cfg.vision.enabled
    model = build_gpt_model(
        cfg.model,
        mtp_cfg=cfg.mtp,
        vocab_size=vocab_size,
        max_sequence_length=aligned_length(cfg.data.max_seq_len, cfg.alignment),
        seed=cfg.trainer.seed,
        cp_size=cfg.cp.size,
        tp_size=cfg.parallel.tp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        device=None if vision else device,
        deterministic=cfg.trainer.deterministic,
        cp_comm_type=cfg.cp.comm_type,
        mrope_section=cfg.vision.mrope_section if vision else None,
        pp_size=cfg.parallel.pp,
        calculate_per_token_loss=engine_class(cfg).model_per_token_loss(cfg),
    )
    if not vision:
        return model
    from recipe.model.vision import build_vision_language_model

    model = build_vision_language_model(
        model,
        cfg.vision,
        cfg.data.shapes.image_size,
        seed=cfg.trainer.seed,
        cp_size=cfg.cp.size,
        cp_rank=cp_rank,
    )
    return model.to(device) if device is not None else model
