"""Check a CP preprocessing function against the ground truth: `python -m recipe.check_preprocess
package.module:function` (or a built-in: index, verl_fixed, verl_legacy).

Hypothesis draws micro-batches (cp 2/4/8, tp 1/2; sequences of length 1, shorter than 2*cp,
k*2*cp-1 / k*2*cp / k*2*cp+1, long ones, up to 12 of them) and runs the function on every rank of
each; on a difference it shrinks the case to a minimal one and prints it: lengths, cp, tp, rank,
slot, field, expected and got. Exit 1 on a failure, 0 with the number of cases checked, 2 when
the function cannot be loaded or `--cases` is below 1. The contract is in
`recipe/parallel/cp/contract.py`.

`python -m recipe.check_preprocess --mutants [--cases N] [--seed S]` runs the same search on each
broken copy of the contract function in `recipe/checks/mutants.py` and prints CAUGHT or MISSED
with the minimal case, then the mutation score: exit 0 when every mutant is caught, 1 when one is
missed, 2 when a function is given as well.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from recipe.checks.arguments import at_least
from recipe.checks.assess import micro_batches
from recipe.checks.search import search
from recipe.parallel.cp.contract import ContractError, Mismatch, first_mismatch, load_function


@dataclass(frozen=True)
class Raised:
    """A function that raised on a valid micro-batch: training would stop there."""

    lengths: tuple[int, ...]
    cp_size: int
    tp_size: int
    error: str
    where: str

    def describe(self) -> str:
        return (
            f"lengths={list(self.lengths)} cp={self.cp_size} tp={self.tp_size}: raises "
            f"{self.error} ({self.where})"
        )


def check(fn, cases: int = 1000, seed: int = 0) -> tuple[Mismatch | Raised | None, int]:
    """(the minimal failing case or None, how many cases ran). A function that raises on a
    valid micro-batch fails with the minimal case that raises (a shape the contract refuses
    still stops the check: ContractError)."""

    def one(case):
        try:
            return first_mismatch(fn, *case)
        except ContractError:
            raise
        except Exception as err:  # the user's code: any error is a finding, shrunk like one
            frames = traceback.extract_tb(err.__traceback__)
            own = getattr(getattr(fn, "__code__", None), "co_filename", None)
            # the user's own line, not the library call it made that raised
            frame = next((f for f in reversed(frames) if f.filename == own), frames[-1])
            lengths, cp_size, tp_size = case
            return Raised(tuple(lengths), cp_size, tp_size, f"{type(err).__name__}: {err}",
                          f"{Path(frame.filename).name}:{frame.lineno}")  # fmt: skip

    return search(micro_batches(), one, cases, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.check_preprocess", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "function", nargs="?", help="package.module:function, or index/verl_fixed/verl_legacy"
    )
    parser.add_argument(
        "--mutants", action="store_true", help="score the checker on its broken functions instead"
    )
    parser.add_argument("--cases", type=at_least(1), default=None, metavar="N",
                        help="micro-batches to draw, 1 or more (1000; 100 per mutant)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (0)")
    args = parser.parse_args(argv)
    if args.mutants:
        if args.function is not None:
            print(f"check_preprocess: give a FUNCTION or --mutants, not both (got "
                  f"{args.function} and --mutants)", file=sys.stderr)  # fmt: skip
            return 2
        return score_mutants(100 if args.cases is None else args.cases, args.seed)
    if args.function is None:
        print("check_preprocess: give a FUNCTION to check, or --mutants", file=sys.stderr)
        return 2
    args.cases = 1000 if args.cases is None else args.cases
    try:
        fn = load_function(args.function)
    except ValueError as err:
        print(f"check_preprocess: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        mismatch, ran = check(fn, args.cases, args.seed)
    except ContractError as err:
        print(f"FAIL {args.function}: breaks the contract: {err}")
        return 1
    took = time.perf_counter() - start
    if mismatch is not None:
        print(f"FAIL {args.function} (minimal case after {ran} cases, {took:.1f} s):")
        print(f"  {mismatch.describe()}")
        return 1
    print(f"PASS {args.function}: {ran} cases on every rank, {took:.1f} s")
    return 0


def score_mutants(cases: int, seed: int) -> int:
    """One line per mutant of `recipe.checks.mutants`, then the score; 0 when all are caught."""
    from recipe.checks import mutants

    start = time.perf_counter()
    scores = mutants.score(cases, seed)
    width = max(len(s.mutant.name) for s in scores)
    for s in scores:
        if s.caught:
            print(f"CAUGHT {s.mutant.name:<{width}}  {s.finding.describe()}")
        else:
            print(f"MISSED {s.mutant.name:<{width}}  passed {s.cases} cases: {s.mutant.pattern}")
    caught = sum(s.caught for s in scores)
    took = time.perf_counter() - start
    print(f"mutation score: {caught}/{len(scores)} caught ({cases} cases each, {took:.1f} s)")
    return 0 if caught == len(scores) else 1
