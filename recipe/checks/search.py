"""The checkers' one search: draw cases from a hypothesis strategy until a case yields a finding,
then let hypothesis shrink it to a minimal one. `check_preprocess` (a user's function), its
mutation score and `check_upstream` (released functions) all search through it."""

from __future__ import annotations


class _Failed(Exception):
    def __init__(self, mismatch):
        super().__init__(mismatch.describe())
        self.mismatch = mismatch


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
