"""Check the CP preprocessing functions of a released library against the ground truth:
`python -m recipe.check_upstream LIBRARY[@VERSION] [--function NAME] [--cases N] [--seed S]
[--fixed KEY=VALUE ...] [--min-length N] [--control [function|inverse]]`.

LIBRARY is `verl` or `megatron-bridge`; without a version the installed release is read, with
one its wheel is fetched with pip (no dependencies) into a cache. Each function runs twice: at
its default options, then with every option of its signature that changes the layout drawn
(`--fixed` pins one). Micro-batches are drawn as by `recipe.check_preprocess` (cp 2/4/8, tp 1/2);
on a difference hypothesis shrinks the case and the minimal one is printed with the options, the
rank, slot, field, expected and got. A function that raises on a valid input is a finding too.
Functions with a gathering inverse (verl's postprocess_*) also round-trip a per-token tensor on
every case: sharded on every rank and gathered back, it must equal the original.
`--control` runs each function's deliberately broken copy instead, which must be flagged
(`--control inverse`: the gathering function's broken copy, the round trip's control).
Exit 0 = every function passed, 1 = a finding, 2 = cannot run (says what is missing).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from recipe.check_preprocess import micro_batches, search
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


def run(spec: str, function: str | None, cases: int, seed: int, fixed: dict,
        control: str | None, min_length: int = 1) -> int:  # fmt: skip
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
    parser.add_argument("library", help="verl or megatron-bridge, optionally @VERSION")
    parser.add_argument("--function", help="check only this function (as the report names it)")
    parser.add_argument("--cases", type=int, default=200, help="micro-batches per mode (200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (0)")
    parser.add_argument("--fixed", action="append", default=[], metavar="KEY=VALUE",
                        help="pin a drawn option, e.g. use_fp8_padding=false")  # fmt: skip
    parser.add_argument("--min-length", type=int, default=1, metavar="N",
                        help="draw sequences of at least N tokens (1): look past a finding on "
                        "short sequences")  # fmt: skip
    parser.add_argument("--control", nargs="?", const="function", choices=["function", "inverse"],
                        help="check a broken copy of each function, or of its gathering inverse "
                        "(must FAIL)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        return run(args.library, args.function, args.cases, args.seed, parse_fixed(args.fixed),
                   args.control, args.min_length)  # fmt: skip
    except UpstreamUnavailable as err:
        print(f"check_upstream: {args.library}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
