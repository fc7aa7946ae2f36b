"""Counting what waits for the GPU, by whose code: `counting_host_reads` (the host reads of
tensors, the CPU's count) and `counting_cuda_syncs` (torch's sync debug mode, on a GPU), each
by `code_owner` ("recipe", "megatron" or "other")."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

import recipe

HOST_READS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")
"""The tensor methods that copy a value to the host: on a GPU each waits for the queued work."""

RECIPE_SOURCES = str(Path(recipe.__file__).parent) + os.sep


def code_owner(filename: str) -> str:
    """Whose code a frame's file is: "recipe", "megatron" or "other"."""
    if filename.startswith(RECIPE_SOURCES):
        return "recipe"
    return "megatron" if f"{os.sep}megatron{os.sep}" in filename else "other"


@contextlib.contextmanager
def counting_host_reads():
    """Count the host reads of tensors (`HOST_READS`) made while open, by whose code made them
    (the direct caller's file: `code_owner`): on a GPU each is a synchronisation, so this is the
    CPU's count of what `counting_cuda_syncs` counts on a GPU. Yields the counts."""
    counts = {"recipe": 0, "megatron": 0, "other": 0}
    missing = object()
    own = {name: torch.Tensor.__dict__.get(name, missing) for name in HOST_READS}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts[code_owner(sys._getframe(1).f_code.co_filename)] += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    try:
        yield counts
    finally:
        for name, attribute in own.items():
            if attribute is missing:
                delattr(torch.Tensor, name)  # inherited again from torch's C base
            else:
                setattr(torch.Tensor, name, attribute)


@contextlib.contextmanager
def counting_cuda_syncs():
    """Count the synchronising CUDA calls made while open (torch's sync debug mode), by whose
    code made them (the innermost Python frame: `code_owner`). The counts are filled in when
    the context closes."""
    counts = {"recipe": 0, "megatron": 0, "other": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            counts[code_owner(warning.filename)] += 1
