"""The checker's mutation score: every broken copy of the contract function in
recipe/checks/mutants.py is caught and shrunk to a small case that fails on its own, the right
functions scored by the same machinery are missed (so a miss can be reported), and the CLI prints
the score with its exit codes. One score of the whole catalogue is shared by the module."""

from __future__ import annotations

import re

import pytest

from recipe.checks import mutants
from recipe.checks.preprocess import main
from recipe.parallel.cp import contract

CASES = 100
SEED = 0
# A mutant the checker cannot catch is a finding about the checker, kept in the catalogue: the
# checker accepts a layout a function returns when each sequence is a multiple of 2*cp, never
# asking for the tp factor the contract pads with.
CHECKER_GAPS: set[str] = set()
# Bugs in where a sequence's slots start: the first sequence starts at 0 whatever the offsets,
# so it takes a second one to show them.
TWO_SEQUENCES = {
    "sequences_sorted_by_length",
    "real_offsets_for_local_slots",
    "per_rank_token_count_offsets",
    "cu_offset_divided_before_padding",
    "positions_global",
    "roll_with_real_offsets",
}
NAMES = [m.name for m in mutants.MUTANTS]
CAUGHT = [name for name in NAMES if name not in CHECKER_GAPS]


@pytest.fixture(scope="module")
def scores() -> dict[str, mutants.Score]:
    return {s.mutant.name: s for s in mutants.score(CASES, SEED)}


def test_the_catalogue_has_thirty_named_mutants():
    assert len(mutants.MUTANTS) >= 30
    assert len(set(NAMES)) == len(NAMES), "names are unique"
    for m in mutants.MUTANTS:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", m.name), m.name
        assert m.pattern and "\n" not in m.pattern, m.name
        assert callable(m.function)
    assert set(CHECKER_GAPS) | TWO_SEQUENCES <= set(NAMES)


@pytest.mark.parametrize("name", CAUGHT)
def test_each_mutant_is_caught_on_a_small_case_that_fails_on_its_own(scores, name):
    s = scores[name]
    assert s.caught, f"{name} passed {s.cases} cases: {s.mutant.pattern}"
    finding = s.finding
    assert len(finding.lengths) <= (2 if name in TWO_SEQUENCES else 1), finding.describe()
    case = (s.mutant.function, list(finding.lengths), finding.cp_size, finding.tp_size)
    if finding.raised is None:
        assert contract.first_mismatch(*case) == finding.mismatch
    else:
        with pytest.raises(Exception) as raised:
            contract.first_mismatch(*case)
        assert type(raised.value).__name__ == finding.raised
    assert mutants.case_finding(*case) == finding


@pytest.mark.parametrize("name", sorted(CHECKER_GAPS))
def test_the_checker_gaps_are_still_gaps(scores, name):
    """When the checker learns to catch one, move it out of CHECKER_GAPS (and docs/mutants.md)."""
    s = scores[name]
    assert not s.caught, f"now caught: {s.finding.describe()}"
    assert s.cases == CASES


@pytest.mark.parametrize("name", ["index", "verl_fixed"])
def test_a_right_function_scores_as_missed(name):
    right = mutants.Mutant(name, "not a mutant: the right function", contract.built_in(name))
    s = mutants.score_one(right, CASES, SEED)
    assert not s.caught and s.finding is None and s.cases == CASES


def test_the_cli_prints_every_mutant_and_the_score(scores, monkeypatch, capsys):
    monkeypatch.setattr(mutants, "score", lambda cases, seed: list(scores.values()))
    assert main(["--mutants", "--cases", str(CASES)]) == (1 if CHECKER_GAPS else 0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(NAMES) + 1
    for line, name in zip(lines, NAMES):
        verdict = "MISSED" if name in CHECKER_GAPS else "CAUGHT"
        assert re.match(rf"{verdict} {name} +\S", line), line
        if verdict == "CAUGHT":
            assert line.endswith(scores[name].finding.describe())
    caught = len(NAMES) - len(CHECKER_GAPS)
    assert re.fullmatch(
        rf"mutation score: {caught}/{len(NAMES)} caught \({CASES} cases each, [0-9.]+ s\)",
        lines[-1],
    )


def test_the_cli_exits_0_when_all_are_caught_and_1_on_a_miss(monkeypatch, capsys):
    # Both fail on the simplest micro-batch, the first hypothesis draws: a few cases suffice.
    names = ("positions_from_one", "last_sequence_dropped")
    few = tuple(m for m in mutants.MUTANTS if m.name in names)
    monkeypatch.setattr(mutants, "MUTANTS", few)
    assert main(["--mutants", "--cases", "5"]) == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^CAUGHT {name} +lengths=", out, re.M) for name in names), out
    assert "mutation score: 2/2 caught (5 cases each, " in out

    right = mutants.Mutant("index", "the right function", contract.index_preprocess)
    monkeypatch.setattr(mutants, "MUTANTS", (*few, right))
    assert main(["--mutants", "--cases", "5"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^MISSED index +passed 5 cases: the right function$", out, re.M), out
    assert "mutation score: 2/3 caught (5 cases each, " in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["index", "--mutants"], "give a FUNCTION or --mutants, not both"),
        ([], "give a FUNCTION to check, or --mutants"),
    ],
)
def test_a_function_and_mutants_together_or_neither_is_a_usage_error(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out
