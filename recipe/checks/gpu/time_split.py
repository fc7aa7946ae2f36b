"""Where a training step's time goes, for mfu_1b: a few steps under torch's profiler, with a
named range around each part of the forward pass and the optimizer step, and the backward pass
told apart by its autograd nodes.

The parts (ranges are set only while profiling, so training pays nothing otherwise):
- attention: every `*.core_attention` module's forward (the recipe's `PackedCausalAttention` or
  megatron's TE attention), and the backward nodes of the attention kernels (their names hold
  "attention", "flash", "varlen" or "sdp");
- rope: megatron's THD RoPE function (`_apply_rotary_pos_emb_thd`, the recipe's vectorised one
  once installed), forward only;
- mlp: every `*.mlp` module's forward;
- loss: megatron's vocab-parallel cross entropy, forward, and its backward node;
- optimizer: the engine's step (`engine.apply`), and any `Optimizer.step#` range torch adds;
- backward, other: every other autograd node (the RoPE's, the MLP's and the projections' matmuls:
  their nodes are generic, `MmBackward0` and the like, and cannot be told apart by name).

Times are the device's (kernel time) on CUDA and the CPU's otherwise, per step; `step_s` is the
wall time of the profiled steps (profiling slows them: compare the parts with each other, not
with the unprofiled steps' MFU). Checked on the CPU; on a GPU only against torch's profiler API.
"""

from __future__ import annotations

import contextlib
import time

import torch

PREFIX = "recipe.split::"
PARTS = ("attention", "rope", "mlp", "loss", "optimizer")
BACKWARD = "autograd::engine::evaluate_function: "
ATTENTION_NODES = ("attention", "flash", "varlen", "sdp")
LOSS_NODES = ("crossentropy", "nllloss", "logsoftmax")


def ranged(name: str, function):
    """`function` inside a profiler range named for part `name`."""

    def inside(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + name):
            return function(*args, **kwargs)

    return inside


def _modules(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


@contextlib.contextmanager
def labelled_parts(trainer):
    """The parts of `trainer`'s steps inside named ranges, for the duration (restored after)."""
    import importlib

    from recipe.megatron.rope import ROPE_MODULE

    handles, restore = [], []
    for chunk in _modules(trainer.model):
        for name, module in chunk.named_modules():
            part = {"core_attention": "attention", "mlp": "mlp"}.get(name.rsplit(".", 1)[-1])
            if part is None:
                continue
            ranges: list = []

            def enter(_module, _args, part=part, ranges=ranges):
                ranges.append(torch.profiler.record_function(PREFIX + part))
                ranges[-1].__enter__()

            def leave(_module, _args, _output, ranges=ranges):
                ranges.pop().__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    rope = importlib.import_module(ROPE_MODULE)
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    for owner, attribute, part in (
        (rope, "_apply_rotary_pos_emb_thd", "rope"),
        (tensor_parallel, "vocab_parallel_cross_entropy", "loss"),
        (trainer.engine, "apply", "optimizer"),
    ):
        original = getattr(owner, attribute)
        setattr(owner, attribute, ranged(part, original))
        restore.append((owner, attribute, original))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, attribute, original in restore:
            setattr(owner, attribute, original)


def _time(event, cuda: bool) -> float:
    """An aggregated event's time in seconds, its children included."""
    if cuda:
        micros = getattr(event, "device_time_total", None)
        if micros is None:  # torch before device_time_total
            micros = event.cuda_time_total
    else:
        micros = event.cpu_time_total
    return micros / 1e6


def part_of(key: str) -> str | None:
    """The part an aggregated profiler event counts toward, or None (inside another one)."""
    if key.startswith(PREFIX):
        return key[len(PREFIX) :]
    if key.startswith("Optimizer.step#"):
        return "optimizer"
    if key.startswith(BACKWARD):
        node = key[len(BACKWARD) :].lower()
        if any(word in node for word in ATTENTION_NODES):
            return "attention"
        if any(word in node for word in LOSS_NODES):
            return "loss"
        return "backward, other"
    return None


def split(events, cuda: bool, steps: int, step_s: float) -> dict:
    """Seconds per step of each part, from `key_averages()` of the profiled steps. A torch
    `Optimizer.step#` range inside the engine's step is not counted twice."""
    seconds = dict.fromkeys((*PARTS, "backward, other"), 0.0)
    ranged_step = any(e.key == PREFIX + "optimizer" for e in events)
    for event in events:
        part = part_of(event.key)
        if part is None or (ranged_step and event.key.startswith("Optimizer.step#")):
            continue
        seconds[part] += _time(event, cuda)
    per_step = {part: total / steps for part, total in seconds.items()}
    return {
        "clock": "device (kernel) time" if cuda else "CPU time",
        "steps": steps,
        "step_s": step_s / steps,
        "parts_s": per_step,
    }


@contextlib.contextmanager
def profiled_steps(after: int, steps: int, cuda: bool, result: dict):
    """Profile `steps` optimizer steps once `after` have run, in whatever trains inside (the
    Trainer built by `train(cfg)`); `result` gets the split when they are done."""
    from recipe.training.trainer import Trainer

    original = Trainer.train_step
    state: dict = {}

    def stepped(trainer):
        if trainer.step == after and "profiler" not in state:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            state["open"] = contextlib.ExitStack()  # closes the profiler first, then the ranges
            state["open"].enter_context(labelled_parts(trainer))
            state["profiler"] = state["open"].enter_context(
                torch.profiler.profile(activities=activities)
            )
            state["start"], state["done"] = time.perf_counter(), 0
        metrics = original(trainer)
        if "profiler" in state and state["done"] < steps:
            state["done"] += 1
            if state["done"] == steps:
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - state["start"]
                state["open"].close()
                result.update(split(state["profiler"].key_averages(), cuda, steps, wall))
        return metrics

    Trainer.train_step = stepped
    try:
        yield result
    finally:
        Trainer.train_step = original
        if "open" in state:  # training ended before the profiled steps did: a no-op otherwise
            state["open"].close()
