"""trainer.engine=megatron: megatron-core's own DDP, optimizer, scheduler and schedules.

What Megatron-LM's `pretrain_gpt.py` (and verl's and Megatron-Bridge's megatron engines) run: the
model in `DistributedDataParallel`, the optimizer from `get_megatron_optimizer` (the distributed
optimizer too), `OptimizerParamScheduler` for the learning rate and weight decay, the step through
`get_forward_backward_func()` (no pipelining, or 1F1B at parallel.pp > 1) with a
`forward_step(data_iterator, model)` / loss function pair in Megatron-LM's contract, and
`finalize_model_grads`. The recipe adds nothing to the numbers but what a config option names
(`trainer.megatron.sync_mtp_position_embeddings`); on a CPU the CUDA-only calls megatron makes
are neutralised from outside first (recipe/megatron/cpu_patches.py).
"""

from __future__ import annotations

import inspect

import torch

from recipe.checkpoint.optimizer_state import load_torch_optimizer_state, torch_optimizer_state
from recipe.parallel import collectives, groups
from recipe.training.micro_batch import REPORT


def scheduler_steps(step: int, warmup_steps: int) -> int:
    """megatron's scheduler position that gives step `step` (1-based) the recipe's rate.

    megatron's warmup rate is max_lr * num_steps / warmup (0 at its first step), the recipe's
    lr * step / warmup over steps 1..warmup, and its cosine starts at step warmup + 1 with
    progress 0, where megatron's reaches progress 0 at num_steps = warmup: so num_steps is the
    step during warmup and one less after it."""
    return step if step <= warmup_steps else step - 1


def build_scheduler(optimizer, cfg):
    """OptimizerParamScheduler with the recipe's linear warmup, cosine decay to optim.min_lr at
    trainer.max_steps and constant weight decay (biases and norms get wd_mult 0)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, total = cfg.optim, cfg.trainer.max_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        # megatron divides by (decay - warmup): at least one step of decay
        lr_decay_steps=max(total, o.warmup_steps + 1),
        lr_decay_style="cosine",
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(total, 1),
        wd_incr_style="constant",
    )


class MegatronEngine:
    """This rank's model (or pipeline stage) in megatron's DDP, optimizer and schedule."""

    name = "megatron"

    @staticmethod
    def model_per_token_loss(cfg) -> bool:
        """The model's `calculate_per_token_loss`, which megatron's schedule and MTP loss read:
        trainer.megatron.calculate_per_token_loss."""
        return cfg.trainer.megatron.calculate_per_token_loss

    def __init__(self, model, cfg, layout):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = model
        self.cfg = cfg
        self.layout = layout
        options = cfg.trainer.megatron
        self.options = options
        config = model.config
        self.sync_positions = self._stage_position_embedding(model, cfg, layout)
        if self.sync_positions is not None and options.sync_mtp_position_embeddings:
            # Its own bucket, aligned alike on both stages, so that summing the two stages' copies
            # after the distributed optimizer's reduce-scatter adds the same shard (megatron does
            # this for the word embedding it shares between stages).
            self.sync_positions.shared_embedding = True
            if not layout.is_first_stage:
                # megatron's mark of a second copy: the gradient norm counts the first stage's
                self.sync_positions.shared = True
        self.ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                overlap_grad_reduce=options.overlap_grad_reduce,
                use_distributed_optimizer=options.use_distributed_optimizer,
                average_in_collective=options.average_in_collective,
            ),
            module=model,
        )
        if options.overlap_grad_reduce:  # as Megatron-LM's training loop wires it
            config.no_sync_func = self.ddp.no_sync
            config.grad_sync_func = self.ddp.start_grad_sync
        config.finalize_model_grads_func = finalize_model_grads
        o = cfg.optim
        optimizer_config = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            clip_grad=o.grad_clip,
            use_distributed_optimizer=options.use_distributed_optimizer,
            params_dtype=torch.float32,
        )
        kwargs = {}
        if "use_gloo_process_groups" in inspect.signature(get_megatron_optimizer).parameters:
            kwargs["use_gloo_process_groups"] = False  # the recipe creates no gloo side groups
        self.optimizer = get_megatron_optimizer(optimizer_config, [self.ddp], **kwargs)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.forward_backward_func = get_forward_backward_func()

    @staticmethod
    def _stage_position_embedding(model, cfg, layout):
        """At pp > 1 with MTP and learned positions, the position embedding this stage holds:
        the first stage's for the decoder, the last stage's own copy for its MTP block (None on
        the stages between, and in every other setting)."""
        if not (layout.pp_size > 1 and cfg.mtp.enabled):
            return None
        if cfg.model.position_embedding_type != "learned_absolute":
            return None
        if not (layout.is_first_stage or layout.is_last_stage):
            return None
        return model.embedding.position_embeddings.weight

    def _inner_optimizers(self) -> list:
        """megatron's optimizers behind the one it returned (a ChainedOptimizer holds several)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def optimizer_state(self) -> dict:
        """{parameter: {"step", "exp_avg", "exp_avg_sq"}} of this rank's model (or stage), the
        distributed optimizer's shards joined over its data-parallel group."""
        state = {}
        for inner in self._inner_optimizers():
            if _is_distributed(inner):
                state.update(_joined_shard_state(inner, self.model))
            else:  # the plain fp32 optimizer wraps torch's AdamW on the model's parameters
                state.update(torch_optimizer_state(inner.optimizer))
        return state

    def load_optimizer_state(self, moments: dict) -> None:
        """Give every optimizer its part of `moments` (from `load_full_state`)."""
        for inner in self._inner_optimizers():
            if _is_distributed(inner):
                _load_shard_state(inner, moments)
            else:
                mine = {p: moments[p] for g in inner.optimizer.param_groups for p in g["params"]}
                load_torch_optimizer_state(inner.optimizer, mine)

    def gradient_divisor(self, work) -> float:
        """What megatron divides every gradient by after backward: with per-token losses the
        step's global token count (finalize_model_grads), else dp x cp (DDP's average)."""
        if self.options.calculate_per_token_loss:
            return float(work.global_predicted_tokens)
        return float(self.layout.dp_size * self.layout.cp_size)

    def begin_step(self, step: int) -> float:
        target = scheduler_steps(step, self.cfg.optim.warmup_steps)
        self.scheduler.step(increment=target - self.scheduler.num_steps)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(self.optimizer.param_groups[0]["lr"])

    def forward_backward(self, micro, training: bool = True) -> torch.Tensor:
        """megatron's schedule over the step's micro-batches; this rank's report totals (zeros
        on the stages without the loss)."""
        work = micro.work
        count = len(work.micro_batches)
        device = next(self.model.parameters()).device
        totals = torch.zeros(len(micro.names), 2, dtype=torch.float64, device=device)
        if count == 0:  # a data-parallel rank with no sequence this step
            if training:
                self._finalize_without_micro_batches(device)
            return totals
        reports = self.forward_backward_func(
            forward_step_func=micro.megatron_forward_step,
            data_iterator=iter(range(count)),
            model=[self.ddp],
            num_microbatches=count,
            seq_length=max(b.input_ids.numel() for b in work.micro_batches),
            micro_batch_size=1,
            forward_only=not training,
        )
        for report in reports or []:
            totals += report[REPORT]
        return totals

    def _finalize_without_micro_batches(self, device: torch.device) -> None:
        """megatron's schedule needs a micro-batch to run, but the gradient reduction after it is
        collective: a rank with none joins it with its zero gradients and zero tokens, as the
        schedule would after backward (finalize_model_grads sums the token counts over dp x cp
        and divides by the total)."""
        if self.options.overlap_grad_reduce:  # no backward hook issued the buckets' reductions
            self.ddp.start_grad_sync()
        config = self.model.config
        tokens = None
        if config.calculate_per_token_loss:
            tokens = torch.zeros([], dtype=torch.int, device=device)
        config.finalize_model_grads_func([self.ddp], tokens)

    def reduce_gradients(self) -> None:
        """finalize_model_grads ran inside the schedule; what remains is the recipe's optional
        sum of the MTP stage's position embedding, then megatron's copy of main_grad to grad."""
        if self.sync_positions is not None and self.options.sync_mtp_position_embeddings:
            self._sum_position_embedding_grads()
        self.optimizer.prepare_grads()

    def _sum_position_embedding_grads(self) -> None:
        collectives.all_reduce_sum(self.sync_positions.main_grad, groups.embedding_group())

    def gradient_norm(self) -> float:
        return float(self.optimizer.get_grad_norm())

    def apply(self) -> None:
        """Clip to optim.grad_clip and step (megatron's optimizer.step(), after the norm the
        trainer's guard has judged)."""
        if self.cfg.optim.grad_clip > 0:
            self.optimizer.clip_grad_norm(self.cfg.optim.grad_clip)
        self.optimizer.step_with_ready_grads()

    def train(self, mode: bool = True) -> None:
        self.ddp.train(mode)


def _is_distributed(optimizer) -> bool:
    return hasattr(optimizer, "gbuf_ranges") and hasattr(optimizer, "model_param_group_index_map")


def _owned_ranges(optimizer):
    """(model parameter, Range of its flattened elements this rank's optimizer shard holds)."""
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                for param, range_map in bucket_map["param_map"].items():
                    if range_map["param"].size > 0:
                        yield param, range_map["param"]


def _shard_states(optimizer, param):
    """The torch optimizer's shard parameter and its state dict for a model parameter."""
    group, order = optimizer.model_param_group_index_map[param]
    shard = optimizer.optimizer.param_groups[group]["params"][order]
    return shard, optimizer.optimizer.state[shard]


def _joined_shard_state(optimizer, model) -> dict:
    """Every parameter's whole optimizer state, from the shards of the distributed optimizer's
    data-parallel ranks (each flattened element is held by exactly one of them)."""
    params = list(model.parameters())
    position = {id(p): i for i, p in enumerate(params)}
    mine = {}
    for param, owned in _owned_ranges(optimizer):
        _, state = _shard_states(optimizer, param)
        tensors = {k: v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
        mine[position[id(param)]] = (owned.start, owned.end, tensors)
    joined: dict = {}
    for part in collectives.gather_to_all(mine, optimizer.data_parallel_group):
        for index, (start, end, tensors) in part.items():
            param = params[index]
            entry = joined.setdefault(param, {})
            for key, value in tensors.items():
                if value.dim() == 0:  # Adam's step: the same on every rank
                    entry[key] = value
                    continue
                flat = entry.setdefault(key, torch.zeros(param.numel(), dtype=value.dtype))
                flat[start:end] = value.reshape(-1)
    return {
        p: {k: v if v.dim() == 0 else v.view(p.shape).to(p.device) for k, v in e.items()}
        for p, e in joined.items()
    }


def _load_shard_state(optimizer, moments: dict) -> None:
    """Each rank takes its slice of every parameter's state (and its main parameter shard,
    from the weights already loaded into the model)."""
    for param, owned in _owned_ranges(optimizer):
        if param not in moments:
            continue
        shard, _ = _shard_states(optimizer, param)
        with torch.no_grad():
            shard.copy_(param.detach().reshape(-1)[owned.start : owned.end])
        optimizer.optimizer.state[shard] = {
            key: value.clone()
            if value.dim() == 0
            else value.reshape(-1)[owned.start : owned.end].clone().to(shard.device)
            for key, value in moments[param].items()
        }
