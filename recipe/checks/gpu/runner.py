"""Running the GPU check's parts: `run_part` (one part as the report shows it: its status, the
attention kernels it ran and their problem on CUDA, its time and peak memory, an out-of-memory
error with where the part was), `run_checks` (every part, the report rewritten after each) and
`stopping_on_sigterm` (the time cap's SIGTERM reported as the part it stopped)."""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
import traceback
from pathlib import Path

import torch

from recipe.checks.gpu.parts import CHECKS
from recipe.checks.gpu.report import write_report
from recipe.checks.gpu.shared import PartProgress, Skip
from recipe.model.attention import recording_attention_kernels

MATH_KERNEL = "math"
"""torch's reference SDPA kernel: the whole [L, L] score matrix in memory, many times slower
than the fused kernels; on CUDA in bf16 it means the attention was not given what they need."""


class StoppedBySignal(BaseException):
    """SIGTERM (gpu_kit.sh's time cap) arrived while a part ran: a BaseException, so that no
    part's own error handling takes it for a failure of the part."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


# --- running the parts -----------------------------------------------------------------------


def kernel_table(seen) -> dict[str, list[str]]:
    """(dtype, kernel) pairs as {dtype: [kernels]}, sorted: how the report shows them."""
    table: dict[str, list[str]] = {}
    for dtype, kernel in sorted(set(seen)):
        table.setdefault(dtype, []).append(kernel)
    return table


def kernel_problem(kernels: dict[str, list[str]], device: torch.device) -> str | None:
    """On CUDA, bf16 attention must run in a fused kernel (flash, memory-efficient, cuDNN or
    TE's): torch's math kernel there means SDPA was given inputs the fused ones refuse (3-D
    tensors did exactly that, without a word). On the CPU the kernel is recorded, not gated."""
    if device.type == "cuda" and MATH_KERNEL in kernels.get("bfloat16", []):
        return (
            "bf16 attention took torch's math kernel on CUDA; the fused kernels refused the "
            "inputs (4-D [batch, heads, tokens, dim], head size, alignment, mask)"
        )
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def out_of_memory_report(progress: PartProgress, device: torch.device) -> dict:
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return {
        "device": str(device),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "doing": progress.doing,
        "step": progress.step,
        "lengths": progress.lengths,
    }


def run_part(name: str, part, device: torch.device, quick: bool = False, **options) -> dict:
    """One part, `part(quick, device, progress, **options)`, as the report shows it: status
    (info for a part without a verdict), its results, the attention kernels it ran, its time and
    (on CUDA) peak memory. A Skip is "skipped" with the reason; an out-of-memory error is a
    failure with the peak memory and where the part was; any other error a failure with its
    traceback; on CUDA a bf16 attention on the math kernel fails a part that passed."""
    progress = PartProgress()
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    out_of_memory = False
    with recording_attention_kernels() as seen:
        try:
            result = part(quick, device, progress, **options)
        except Skip as why:
            entry = {"status": "skipped", "reason": str(why)}
        except torch.OutOfMemoryError as err:  # torch.cuda.OutOfMemoryError is this class
            out_of_memory = True
            entry = {
                "status": "fail",
                "reason": f"out of memory: {_first_line(err)}",
                "out_of_memory": out_of_memory_report(progress, device),
                "traceback": traceback.format_exc(limit=-10),  # innermost: which operation asked
            }
        except Exception as err:  # a part that crashed is a failure, with its traceback
            entry = {
                "status": "fail",
                "reason": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(limit=-10),  # the innermost frames
            }
        else:
            passed = result.pop("passed", None)
            status = "info" if passed is None else "pass" if passed else "fail"
            entry = {"status": status, **result}
    entry["attention_kernels"] = kernels = kernel_table(seen | progress.kernels)
    problem = kernel_problem(kernels, device)
    if problem:
        entry["kernel_problem"] = problem
        if entry["status"] in ("pass", "info"):
            entry["status"], entry["reason"] = "fail", problem
    if cuda:
        entry["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    entry["seconds"] = round(time.perf_counter() - start, 2)
    if out_of_memory:  # give the next part the memory the failed one held
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return entry


def run_checks(
    quick: bool,
    only: list[str] | None = None,
    out: Path | None = None,
    device: torch.device | None = None,
    checks: dict | None = None,
) -> dict:
    """Every part of `checks` (CHECKS) or those named in `only` (versions always), on `device`
    (the GPU where CUDA is; without it every part after versions is skipped with "no CUDA").
    With `out`, the report is rewritten there before and after every part."""
    from recipe.megatron.cpu_patches import install_cpu_patches
    from recipe.model.numerics import apply_determinism

    checks = CHECKS if checks is None else checks
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda")
    install_cpu_patches()
    # Before any CUDA work: megatron's TE layers refuse deterministic_mode unless
    # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 is already set when they are built.
    apply_determinism(True)
    names = [n for n in checks if not only or n in only or n == "versions"]
    report: dict[str, dict] = {name: {"status": "pending"} for name in names}

    def save():
        if out is not None:
            write_report(out, report)

    for name in names:
        if device is None and name != "versions":
            report[name] = {"status": "skipped", "reason": "no CUDA"}
            continue
        report[name] = {"status": "running", "since": time.strftime("%H:%M:%S")}
        save()
        where = device if device is not None else torch.device("cpu")  # versions, without CUDA
        try:
            # per part: torch elastic's launcher (cp2_one_gpu's ranks) installs its own handler
            with stopping_on_sigterm():
                report[name] = run_part(name, checks[name], where, quick)
        except StoppedBySignal as stop:
            report[name] = {"status": "fail", "reason": f"{stop} while this part ran"}
            save()
            raise
        finally:
            apply_determinism(True)  # mfu_1b turns it off; a later part must not inherit that
        save()
    save()
    return report


@contextlib.contextmanager
def stopping_on_sigterm():
    """SIGTERM (the time cap's first signal) raises StoppedBySignal, so the part under way is
    reported as stopped before the process ends. Only the main thread can take signals: from
    another thread this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise StoppedBySignal(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
