"""Check a CP preprocessing function against the ground truth: `python -m recipe.check_preprocess
package.module:function` (or a built-in: index, verl_fixed, verl_legacy).

Hypothesis draws micro-batches (cp 2/4/8, tp 1/2; sequences of length 1, shorter than 2*cp,
k*2*cp-1 / k*2*cp / k*2*cp+1, long ones, up to 12 of them) and runs the function on every rank of
each; on a difference it shrinks the case to a minimal one and prints it: lengths, cp, tp, rank,
slot, field, expected and got. Exit 1 on a failure, 0 with the number of cases checked, 2 when
the function cannot be loaded or `--cases` is below 1. The contract is in
`recipe/parallel/cp/contract.py`.
"""

from __future__ import annotations

import argparse
import sys
import time

from recipe.checks.arguments import at_least
from recipe.parallel.cp.contract import ContractError, Mismatch, first_mismatch, load_function


class _Failed(Exception):
    def __init__(self, mismatch):
        super().__init__(mismatch.describe())
        self.mismatch = mismatch


def micro_batches(max_sequences: int = 12, max_length: int = 400, min_length: int = 1):
    """(lengths, cp, tp) of the micro-batches the checker draws (every sequence at least
    `min_length` tokens: a way past a finding on short sequences to what else there is)."""
    from hypothesis import strategies as st

    @st.composite
    def draw(draw):
        cp = draw(st.sampled_from([2, 4, 8]))
        tp = draw(st.sampled_from([1, 2]))
        unit = 2 * cp
        length = st.one_of(
            st.just(1),
            st.integers(1, unit - 1),
            st.tuples(st.integers(1, 6), st.sampled_from([-1, 0, 1])).map(
                lambda kd: kd[0] * unit + kd[1]
            ),
            st.integers(1, max_length),
        )
        length = length.map(lambda n: max(n, min_length))
        lengths = draw(st.lists(length, min_size=1, max_size=max_sequences))
        return lengths, cp, tp

    return draw()


def search(strategy, case_mismatch, cases: int, seed: int) -> tuple[object | None, int]:
    """Draw `cases` values of `strategy`; the first for which `case_mismatch(value)` returns a
    finding is shrunk by hypothesis to a minimal one. (the minimal finding or None, cases run)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    ran = 0

    @hypothesis_seed(seed)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(strategy)
    def one_case(case):
        nonlocal ran
        ran += 1
        finding = case_mismatch(case)
        if finding is not None:
            raise _Failed(finding)

    try:
        one_case()
    except _Failed as failed:
        return failed.mismatch, ran
    return None, ran


def check(fn, cases: int = 1000, seed: int = 0) -> tuple[Mismatch | None, int]:
    """(the minimal failing case or None, how many cases ran)."""
    return search(micro_batches(), lambda case: first_mismatch(fn, *case), cases, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.check_preprocess", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("function", help="package.module:function, or index/verl_fixed/verl_legacy")
    parser.add_argument("--cases", type=at_least(1), default=1000, metavar="N",
                        help="micro-batches to draw, 1 or more (1000)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (0)")
    args = parser.parse_args(argv)
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
