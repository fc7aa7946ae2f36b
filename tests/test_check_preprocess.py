"""The checker for anyone's CP preprocessing: passes the right functions, and shrinks each wrong
one (verl's pre-fix formula and four bugs of our own) to a minimal case that really fails."""

from __future__ import annotations

import pytest
import torch

from recipe.checks.preprocess import check, main
from recipe.config.layout import ParallelDims
from recipe.parallel.cp import contract
from recipe.parallel.cp.shard import PreprocessMismatch
from recipe.training.step import plan_step
from tests.helpers.config import typed_config

FAULTY = "tests.helpers.faulty_preprocess"


@pytest.mark.parametrize("name", ["index", "verl_fixed"])
def test_the_right_functions_pass(name, capsys):
    assert main([name, "--cases", "150"]) == 0
    assert f"PASS {name}: 150 cases on every rank" in capsys.readouterr().out


def _minimal(spec: str) -> contract.Mismatch:
    mismatch, ran = check(contract.load_function(spec), cases=400)
    assert mismatch is not None, f"{spec} passed {ran} cases"
    again = contract.first_mismatch(
        contract.load_function(spec), list(mismatch.lengths), mismatch.cp_size, mismatch.tp_size
    )
    assert again == mismatch, "the printed case fails when run on its own"
    return mismatch


def test_verl_legacy_shrinks_to_the_pr_6267_bug(capsys):
    mismatch = _minimal("verl_legacy")
    assert mismatch.field == "position_ids"
    assert mismatch.chunk >= mismatch.cp_size, "a back-chunk position"
    assert mismatch.cp_rank > 0, "rank 0's back chunk is right when unpadded: the bug is elsewhere"
    assert len(mismatch.lengths) == 1 and mismatch.cp_size == 2, "shrunk to one short sequence"
    assert main(["verl_legacy", "--cases", "400"]) == 1
    out = capsys.readouterr().out
    assert "FAIL verl_legacy (minimal case" in out and mismatch.describe() in out


@pytest.mark.parametrize(
    "name, field",
    [
        ("local_label_roll", "labels"),
        ("swapped_chunks_on_last_rank", "input_ids"),
        ("padding_counted_as_real", "loss_mask"),
        ("off_by_one_back_positions", "position_ids"),
    ],
)
def test_each_faulty_function_fails_with_a_minimal_case(name, field):
    mismatch = _minimal(f"{FAULTY}:{name}")
    assert mismatch.field == field
    assert len(mismatch.lengths) == 1, mismatch.describe()
    if name == "swapped_chunks_on_last_rank":
        assert mismatch.cp_rank == mismatch.cp_size - 1
    if name == "padding_counted_as_real":
        assert mismatch.position >= mismatch.lengths[mismatch.sequence], "a padding slot"


def test_a_contract_breach_and_a_bad_name_are_reported(capsys):
    assert main([f"{FAULTY}:wrong_length", "--cases", "5"]) == 1
    assert "breaks the contract: input_ids has shape" in capsys.readouterr().out
    for spec, message in [
        ("no_such_module:fn", "cannot import no_such_module"),
        (f"{FAULTY}:missing", "has no function missing"),
        ("verl", "neither a built-in"),
    ]:
        assert main([spec]) == 2
        assert message in capsys.readouterr().err


def test_a_function_that_raises_fails_with_its_minimal_case(capsys):
    """It was hypothesis's traceback and no FAIL line."""
    assert main([f"{FAULTY}:raises_on_a_single_token", "--cases", "50"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {FAULTY}:raises_on_a_single_token (minimal case after ")
    assert "lengths=[1] cp=2 tp=1: raises RuntimeError: a one-token sequence " in out
    assert "(faulty_preprocess.py:" in out and "Traceback" not in out


def test_a_function_of_another_signature_is_refused_before_the_search(capsys):
    assert main([f"{FAULTY}:takes_no_rank"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("check_preprocess: takes (sequences, cu_seqlens_padded), which cannot")
    assert "fn(sequences, cu_seqlens_padded, cp_size, cp_rank, tp_size=1)" in err


@pytest.mark.parametrize(
    "tool, argv, message",
    [
        ("preprocess", ["index", "--cases", "0"], "argument --cases: must be 1 or more, got 0"),
        ("preprocess", ["index", "--cases", "-5"], "argument --cases: must be 1 or more, got -5"),
        ("upstream", ["verl", "--cases", "0"], "argument --cases: must be 1 or more, got 0"),
        ("upstream", ["megatron-core", "--cases", "-1"], "--cases: must be 1 or more, got -1"),
        ("upstream", ["verl", "--min-length", "0"], "argument --min-length: must be 1 or more"),
        ("upstream", ["verl", "--cases", "ten"], "argument --cases: 'ten' is not a whole number"),
    ],
)
def test_a_count_out_of_range_is_a_usage_error(tool, argv, message, capsys):
    """`--cases 0` ended in hypothesis's traceback with exit 1 (1 means a finding), and
    megatron-core's roll check passed 0 cases with exit 0."""
    from recipe.checks import preprocess
    from recipe.checks.upstream import cli as upstream_cli

    with pytest.raises(SystemExit) as exited:
        {"preprocess": preprocess.main, "upstream": upstream_cli.main}[tool](argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: python -m recipe.check_{tool}") and message in err
    assert "Traceback" not in err


def _plans(preprocess: str, check: bool):
    cfg = typed_config(["cp=2", f"cp.preprocess={preprocess}"])
    sequences = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate([37, 3, 120])]
    dims = ParallelDims(cp=2)
    return [
        plan_step(sequences, cfg, dims.layout_of(rank), 0, torch.device("cpu"), check)
        for rank in range(2)
    ]


def test_a_training_run_uses_a_user_function_and_checks_it_first():
    user = _plans("recipe.parallel.cp.contract:index_preprocess", check=True)
    built_in = _plans("index", check=False)
    for mine, ref in zip(user, built_in):
        for a, b in zip(mine.micro_batches, ref.micro_batches):
            for name in contract.FIELDS:
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(PreprocessMismatch, match="position_ids expected"):
        _plans(f"{FAULTY}:off_by_one_back_positions", check=True)
    unchecked = _plans(f"{FAULTY}:off_by_one_back_positions", check=False)
    shifted = unchecked[1].micro_batches[0].position_ids
    assert not torch.equal(shifted, built_in[1].micro_batches[0].position_ids), "used as given"


def test_a_bad_user_function_is_a_start_up_error():
    """The config checks the spelling only (validation imports nothing of the user's); the
    start-up check imports the module and checks the function's signature."""
    from recipe.errors import ConfigError
    from recipe.launch.preflight import check_preprocess_function

    assert typed_config(["cp.preprocess=nowhere:fn"]).cp.preprocess == "nowhere:fn"
    with pytest.raises(ConfigError, match="cp.preprocess=nowhere:fn: cannot import nowhere"):
        check_preprocess_function("nowhere:fn")
    with pytest.raises(ConfigError, match=r"cp.preprocess=os:getcwd: takes \(\), which cannot"):
        check_preprocess_function("os:getcwd")
    with pytest.raises(ConfigError, match="write package.module:function"):
        typed_config(["cp.preprocess=:fn"])
    check_preprocess_function(f"{FAULTY}:off_by_one_back_positions")  # the contract's shape


@pytest.mark.distributed
def test_a_faulty_user_function_stops_the_run_at_the_first_step(tmp_path):
    from tests.helpers.cli import run_train_cli

    done = run_train_cli(
        ["cp=2", f"cp.preprocess={FAULTY}:off_by_one_back_positions"]
        + [f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert "differs from the index path on a training micro-batch" in done.stderr
    assert "python -m recipe.check_preprocess" in done.stderr
