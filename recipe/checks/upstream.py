"""Check the CP preprocessing functions of a released library against the ground truth:
`python -m recipe.check_upstream LIBRARY[@VERSION] [--function NAME] [--cases N] [--seed S]
[--fixed KEY=VALUE ...] [--min-length N] [--control [function|inverse]]`.

LIBRARY is `verl`, `megatron-bridge` or `megatron-core`; without a version the installed release
is read, with one its wheel is fetched with pip (no dependencies) into a cache. megatron-core's
MTP `roll_tensor` exchanges tokens between CP ranks, so it runs on real gloo ranks (cp 2 and 4)
with the installed release, once per way real callers fill `cu_seqlens_q`. Each function runs
twice: at its default options, then with every option of its signature that changes the layout drawn
(`--fixed` pins one). Micro-batches are drawn as by `recipe.check_preprocess` (cp 2/4/8, tp 1/2);
on a difference hypothesis shrinks the case and the minimal one is printed with the options, the
rank, slot, field, expected and got. A function that raises on a valid input is a finding too.
Functions with a gathering inverse (verl's postprocess_*) also round-trip a per-token tensor on
every case: sharded on every rank and gathered back, it must equal the original.
`--control` runs each function's deliberately broken copy instead, which must be flagged
(`--control inverse`: the gathering function's broken copy, the round trip's control).
Exit 0 = every function passed, 1 = a finding, 2 = cannot run (says what is missing) or a count
out of range (`--cases` and `--min-length` are 1 or more).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from recipe.checks.arguments import at_least
from recipe.checks.preprocess import micro_batches, search
from recipe.log import quiet_libraries
from recipe.parallel.cp.contract import ContractError, first_mismatch
from recipe.upstream.adapters import LIBRARIES, Loaded, load, parse_spec
from recipe.upstream.source import UpstreamUnavailable


@dataclass(frozen=True)
class Finding:
    lengths: tuple[int, ...]
    cp_size: int
    tp_size: int
    options: tuple[tuple[str, object], ...]
    what: str

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options) or "defaults"
        return f"options: {options}; {self.what}"


def case_finding(loaded: Loaded, lengths, cp_size, tp_size, options: dict) -> Finding | None:
    fn = loaded.contract_function(options)
    try:
        mismatch = first_mismatch(fn, list(lengths), cp_size, tp_size)
    except ContractError as err:
        what = f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: breaks the contract: {err}"
    except Exception as err:  # noqa: BLE001 (an upstream function raising is the finding)
        what = (
            f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: raises {type(err).__name__}: {err}"
        )
    else:
        if mismatch is None:
            try:
                problem = loaded.round_trip_problem(lengths, cp_size, tp_size, options)
            except Exception as err:  # noqa: BLE001 (as above)
                problem = (
                    f"lengths={list(lengths)} cp={cp_size} tp={tp_size}: the round trip through "
                    f"{loaded.inverse_name} raises {type(err).__name__}: {err}"
                )
            if problem is None:
                return None
            what = problem
        else:
            what = mismatch.describe()
    return Finding(tuple(lengths), cp_size, tp_size, tuple(sorted(options.items())), what)


def options_strategy(loaded: Loaded, fixed: dict):
    from hypothesis import strategies as st

    drawn = {
        name: st.just(fixed[name]) if name in fixed else st.sampled_from(values)
        for name, values in loaded.drawn.items()
    }
    return st.fixed_dictionaries(drawn)


def check_target(loaded: Loaded, cases: int, seed: int, fixed: dict, drawn: bool,
                 min_length: int = 1):  # fmt: skip
    """(finding or None, cases run) at the defaults (drawn=False) or with options drawn."""
    from hypothesis import strategies as st

    if drawn:
        options = options_strategy(loaded, fixed)
    else:
        options = st.just({k: v for k, v in fixed.items() if k in loaded.drawn})
    strategy = st.tuples(micro_batches(min_length=min_length), options)

    def one(case):
        (lengths, cp_size, tp_size), chosen = case
        chosen = {k: v for k, v in chosen.items() if v is not None}
        return case_finding(loaded, lengths, cp_size, tp_size, chosen)

    return search(strategy, one, cases, seed)


def _value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse_fixed(pairs: list[str]) -> dict:
    fixed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UpstreamUnavailable(
                f"--fixed {pair!r}: write KEY=VALUE, e.g. use_fp8_padding=false"
            )
        fixed[key] = _value(value)
    return fixed


MEGATRON_CORE = "megatron-core"
# How real callers fill PackedSeqParams for megatron's MTP roll (recipe/checks/mtp_roll.py).
ROLL_CALLERS = {
    "padded": "cu_seqlens_q = the padded offsets (as verl passes them)",
    "unpadded": "cu_seqlens_q = the real offsets, cu_seqlens_q_padded = the padded ones (as "
    "Megatron-Bridge's packed SFT passes them)",
}


def run_megatron_core(version: str | None, function: str | None, cases: int, seed: int,
                      fixed: dict, control: str | None, min_length: int) -> int:  # fmt: skip
    """megatron-core's MTP roll_tensor on real gloo ranks (cp 2 and 4), once per way real
    callers fill cu_seqlens_q. It runs the installed release: its ranks import megatron."""
    from recipe.checks import mtp_roll
    from recipe.launch.local import RanksFailed
    from recipe.upstream.source import installed_version

    installed = installed_version(MEGATRON_CORE)
    if version not in (None, installed):
        raise UpstreamUnavailable(
            f"megatron-core's roll_tensor runs on real ranks with the installed release "
            f"({installed}); to check {version}, install it (`pip install megatron-core=="
            f"{version}`, or make setup STACK=legacy for 0.16.1) and run without @VERSION"
        )
    if function not in (None, "roll_tensor"):
        raise UpstreamUnavailable(
            f"megatron-core has no checked function {function!r}; checked: roll_tensor"
        )
    if control == "inverse" or min_length != 1 or set(fixed) - {"cu_seqlens_q"}:
        raise UpstreamUnavailable(
            "megatron-core's roll_tensor takes only --cases, --seed, --control and --fixed "
            "cu_seqlens_q=padded|unpadded"
        )
    kinds = [fixed["cu_seqlens_q"]] if "cu_seqlens_q" in fixed else list(ROLL_CALLERS)
    if set(kinds) - set(ROLL_CALLERS):
        raise UpstreamUnavailable(f"--fixed cu_seqlens_q: one of {', '.join(ROLL_CALLERS)}")
    broken = " [broken copy: function]" if control else ""
    print(f"megatron-core@{installed} roll_tensor (MTP, THD + CP){broken}: "
          "megatron/core/transformer/multi_token_prediction.py")  # fmt: skip
    print("  on real gloo ranks, cp 2 and 4: labels and loss mask rolled on every rank, against "
          "the rolled ground truth")  # fmt: skip
    found = 0
    for kind in kinds:
        start = time.perf_counter()
        try:
            finding, ran = mtp_roll.check_roll(cases=cases, seed=seed, broken=bool(control),
                                               cu_kind=kind)  # fmt: skip
        except mtp_roll.PointToPointTimeout as err:  # the ranks did not fail alike: a finding
            finding, ran = err, cases
        except RanksFailed as err:
            raise UpstreamUnavailable(f"the checker's ranks failed: {err}") from None
        took = time.perf_counter() - start
        if finding is None:
            print(f"  PASS {ROLL_CALLERS[kind]}: {ran} cases (cp 2 and 4), {took:.1f} s")
            continue
        found += 1
        what = finding.describe() if hasattr(finding, "describe") else str(finding)
        print(f"  FAIL {ROLL_CALLERS[kind]} (minimal case, {took:.1f} s):")
        print(f"    {what}")
    return 1 if found else 0


def run(spec: str, function: str | None, cases: int, seed: int, fixed: dict,
        control: str | None, min_length: int = 1) -> int:  # fmt: skip
    library, _, version = spec.partition("@")
    if library == MEGATRON_CORE:
        return run_megatron_core(version or None, function, cases, seed, fixed, control,
                                 min_length)  # fmt: skip
    library, version = parse_spec(spec)
    targets = [t for t in LIBRARIES[library].targets if function in (None, t.name)]
    if not targets:
        names = ", ".join(t.name for t in LIBRARIES[library].targets)
        raise UpstreamUnavailable(
            f"{library} has no checked function {function!r}; checked: {names}"
        )
    loaded_targets = [load(library, version, target) for target in targets]
    drawn_anywhere = {name for loaded in loaded_targets for name in loaded.drawn}
    unknown = set(fixed) - drawn_anywhere
    if unknown:
        raise UpstreamUnavailable(
            f"--fixed {', '.join(sorted(unknown))}: not a drawn option of {spec}'s checked "
            f"functions (drawn: {', '.join(sorted(drawn_anywhere)) or 'none'})"
        )
    if control == "inverse" and not any(loaded.inverse_name for loaded in loaded_targets):
        raise UpstreamUnavailable(
            f"--control inverse: none of {spec}'s checked functions has a gathering inverse"
        )
    found = 0
    for loaded in loaded_targets:
        target = loaded.target
        if control == "inverse" and not loaded.inverse_name:
            print(f"{loaded.label}: no gathering function, no inverse to break (skipped)")
            continue
        if control:
            loaded = loaded.broken_copy(control)
        alias = (
            ""
            if loaded.function_name == target.name.split(".")[-1]
            else (f" (named {loaded.function_name} in this release)")
        )
        print(
            f"{loaded.label}{alias}{f' [broken copy: {control}]' if control else ''}: {target.file}"
        )
        if loaded.inverse_name:
            print(f"  every case also round-trips a per-token tensor through {loaded.inverse_name}")
        for name, why in loaded.skipped.items():
            print(f"  not drawn: {name}: {why}")
        modes = [("default options", False)]
        if loaded.drawn:
            modes.append((f"options drawn ({', '.join(loaded.drawn)})", True))
        for title, drawn in modes:
            start = time.perf_counter()
            finding, ran = check_target(loaded, cases, seed, fixed, drawn, min_length)
            took = time.perf_counter() - start
            if finding is None:
                print(f"  PASS {title}: {ran} cases on every rank, {took:.1f} s")
            else:
                found += 1
                print(f"  FAIL {title} (minimal case after {ran} cases, {took:.1f} s):")
                print(f"    {finding.describe()}")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.check_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "library", help="verl, megatron-bridge or megatron-core, optionally @VERSION"
    )
    parser.add_argument("--function", help="check only this function (as the report names it)")
    parser.add_argument("--cases", type=at_least(1), default=200, metavar="N",
                        help="micro-batches per mode, 1 or more (200)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (0)")
    parser.add_argument("--fixed", action="append", default=[], metavar="KEY=VALUE",
                        help="pin a drawn option, e.g. use_fp8_padding=false")  # fmt: skip
    parser.add_argument("--min-length", type=at_least(1), default=1, metavar="N",
                        help="draw sequences of at least N tokens, 1 or more (1): look past a "
                        "finding on short sequences")  # fmt: skip
    parser.add_argument("--control", nargs="?", const="function", choices=["function", "inverse"],
                        help="check a broken copy of each function, or of its gathering inverse "
                        "(must FAIL)")  # fmt: skip
    args = parser.parse_args(argv)
    quiet_libraries()
    try:
        return run(args.library, args.function, args.cases, args.seed, parse_fixed(args.fixed),
                   args.control, args.min_length)  # fmt: skip
    except UpstreamUnavailable as err:
        print(f"check_upstream: {args.library}: {err}", file=sys.stderr)
        return 2
