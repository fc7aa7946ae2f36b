"""The docs say what the code does: the configuration reference is generated from the schema and
current, and every command in the shell blocks of README.md and docs/ is tested as its family in
FAMILIES says: `train.py` commands compose and validate as written (the app's start-up without
training), the proof and comparison tools run in process and exit with the code their comment
states (`# exit 1`, `must exit 1`) or, where none is stated, not with the bad-input code 2, and a
command that is not run says why. A command of a family the table lacks fails the suite."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import re
import runpy
import shlex
import sys
import tomllib
from dataclasses import dataclass

import pytest

from recipe.config import reference as config_reference
from recipe.launch.compose import compose_config, to_typed
from tests.helpers.doc_commands import ROOT, Command, commands, documented_commands
from tests.helpers.fake_runs import make_run

COMPOSED = "composed"  # the train.py overrides compose and validate; nothing is trained
RUN = "run"  # main(argv) in this process, the exit code asserted
PARSED = "parsed"  # the script's own argument parsing in this process; the body is not run
SKIPPED = "skipped"  # not run, for the reason given
# How many micro-batches each search of check_upstream draws for a documented exit code.
UPSTREAM_DRAWS = 3


@dataclass(frozen=True)
class Family:
    name: str
    pattern: str
    """matched (re.match) against the command's entry and arguments: `python -m MODULE ARGS`,
    `python SCRIPT ARGS`, `PROGRAM ARGS` (leading VAR=value words dropped)"""
    how: str
    why: str
    """how it is tested, and what is stood in for or left out and why"""


# Every kind of command the docs' shell blocks hold, the first match wins. A documented command
# that matches none fails test_every_documented_command_is_in_the_table.
FAMILIES = (
    Family("train.py", r"python train\.py\b", COMPOSED,
           "composed and validated as train.py's start-up does (Hydra's own overrides, the "
           "schema's keys, the typed checks), a multirun's first and last jobs, on this stack "
           "(.venv-legacy's too); not trained: a run takes minutes (a sweep up to ~25 min) and "
           "most start ranks"),
    Family("torchrun ... train.py", r"torchrun\b.* train\.py\b", COMPOSED,
           "the overrides after train.py composed as above; torchrun is not started: it starts "
           "the ranks (processes), and --nnodes=2 needs a second machine"),
    Family("make train", r"make train\b", COMPOSED,
           "ARGS composed as above; not run: it trains the default for ~2 min"),
    Family("sbatch train.sbatch", r"sbatch\b.* scripts/slurm/train\.sbatch\b", COMPOSED,
           "the overrides after train.sbatch (it passes them to train.py) composed as above; "
           "sbatch needs a SLURM cluster"),
    Family("check_upstream --all", r"python -m recipe\.check_upstream\b.* --all\b", SKIPPED,
           "every library and release in one table: many minutes; tests/test_upstream_table.py "
           "checks the table, its docs/upstream.json and --all's argument checks"),
    Family("check_upstream LIBRARY", r"python -m recipe\.check_upstream\b", RUN,
           "main(argv) on the releases' own files (pip fetches the wheels into the cache once: "
           "@pytest.mark.launches). With a documented exit code each search draws its first "
           f"{UPSTREAM_DRAWS} micro-batches, unshrunk, and the worse-class searches too: the "
           "findings, so the code, are the release's own on real cases (a full search takes "
           "minutes; the minimal cases are tests/test_upstream*.py's). Without one the search "
           "is stubbed to find nothing, which proves only that the command gets past every "
           "exit-2 check (library, release, functions, options, report folder)"),
    Family("check_preprocess --mutants", r"python -m recipe\.check_preprocess\b.* --mutants\b",
           RUN,
           "main(argv) with the catalogue cut to two mutants the first draws catch: the command "
           "line, the score and its exit code; the whole catalogue's score (37 mutants, 12.7 s) "
           "is tests/test_mutants.py's"),
    Family("check_preprocess FUNCTION", r"python -m recipe\.check_preprocess\b", RUN,
           "main(argv), a real search (1000 cases); the placeholder my.module:my_preprocess is "
           "a user function with a bug (PLACEHOLDERS): it fails in about a second, where a right "
           "one runs all 1000 cases (~11 s)"),
    Family("compare.diverge", r"python -m recipe\.compare\.diverge\b", RUN,
           "main(argv) on the traces of fake run directories (tests/helpers/fake_runs.py) at "
           "the paths the docs name (RUN_DIRS)"),
    Family("compare", r"python -m recipe\.compare(\s|$)", RUN,
           "main(argv) on fake run directories at the paths the docs name (RUN_DIRS): curves, "
           "per-token records, a golden file exported and then used, in the block's order"),
    Family("scripts/compare_runs.py", r"python scripts/compare_runs\.py\b", RUN,
           "the script itself, as __main__ in this process, on the fake run directories: its "
           "synopsis with every optional part given (PLACEHOLDERS)"),
    Family("benchmarks/*.py", r"python benchmarks/\w+\.py\b", PARSED,
           "the script's own argument parsing (its parse_args, or main stopped once it has "
           "parsed), train.py overrides after -- composed; not run: timings of seconds to "
           "minutes (soak trains thousands of steps) whose --check goals hold on a quiet "
           "machine, not on a loaded CI runner"),
    Family("scripts/gpu_check.py", r"python scripts/gpu_check\.py\b", PARSED,
           "arguments parsed (main stopped once it has parsed); not run: the GPU path needs "
           "CUDA (up to 8 min); tests/test_gpu_check.py runs it without CUDA and its parts' "
           "CPU bodies"),
    Family("make", r"make\b", SKIPPED,
           "each target checked to exist in the Makefile; not run: test and test-fast run the "
           "suite (~10 min, ~2 min), conventions five sweeps (~22 min), bench a timing"),
    Family("scripts/gpu_kit.sh", r"scripts/gpu_kit\.sh\b", SKIPPED,
           "fetch needs PyPI (the network), run and install are for the GPU machine (install, "
           "then gpu_check's 8 min); tests/test_gpu_kit.py runs every subcommand"),
    Family("docker", r"docker\b", SKIPPED,
           "needs docker, and --gpus all a GPU; the image's tests are the suite's -m gpu part"),
    Family("enroot", r"enroot\b", SKIPPED, "a cluster's enroot, importing the docker image"),
    Family("pip install", r"pip install\b", SKIPPED,
           "needs the network and changes the environment; the extra it names is checked to "
           "exist in pyproject.toml"),
)  # fmt: skip

COMMANDS = documented_commands()

# The README's placeholder for your own function: a user function with a bug (a right one would
# run all 1000 cases), and the synopses' placeholders, each optional part ([--rtol X]) given.
FAULTY_USER_FUNCTION = "tests.helpers.faulty_preprocess:off_by_one_back_positions"
PLACEHOLDERS = {
    "my.module:my_preprocess": [FAULTY_USER_FUNCTION],
    "RUN_DIR...": ["outputs/prefix", "outputs/cp1"],
    "RUN_DIR": ["outputs/cp1"],
    "X": ["1e-5"],
    "FILE": ["loss_curves.png"],
    "N": ["100"],
    "S": ["0"],
}
# The run directories the docs' comparison commands name, as fake runs (per-token records of
# steps 1 and 3, a trace of step 1: the walk-through's trainer.record_tokens=[1,3]
# trainer.trace_steps=[1]) at this context-parallel size; the runs agree with each other.
RUN_DIRS = {"outputs/cp1": 1, "outputs/prefix": 2, "outputs/new_run": 2}
# Caught on the first draws (tests/test_mutants.py's test of the CLI's exit codes uses the same).
QUICK_MUTANTS = ("positions_from_one", "last_sequence_dropped")


def family_of(command: Command) -> Family | None:
    line = " ".join([command.entry, *command.argv])
    return next((f for f in FAMILIES if re.match(f.pattern, line)), None)


def _of(name: str = "", how: str = "") -> list[Command]:
    """The documented commands of a family, or of every family tested this way (a command of no
    family is left to test_every_documented_command_is_in_the_table)."""
    return [
        c for c in COMMANDS if (f := family_of(c)) and name in ("", f.name) and how in ("", f.how)
    ]


def _id(value) -> str:
    return f"{value.where}: {value.code}" if isinstance(value, Command) else ""


def runnable(argv: list[str]) -> list[str]:
    """A synopsis made runnable: each optional part given (`[--rtol X]` -> `--rtol 1e-5`), the
    first of alternatives (`cpu|cuda`), the placeholders substituted."""
    words = []
    for word in argv:
        word = word[1:] if word.startswith("[") else word
        word = word[:-1] if word.endswith("]") and "[" not in word else word
        word = word.split("|")[0] if "|" in word and not word.startswith("-") else word
        words += PLACEHOLDERS.get(word, [word])
    return words


# --- the table ----------------------------------------------------------------------------------


def test_every_documented_command_is_in_the_table():
    """A new kind of command in a shell block must say here how it is tested, or why not."""
    unknown = [f"{c.where}: {c.code}" for c in COMMANDS if family_of(c) is None]
    assert not unknown, "commands of no family in FAMILIES (add one):\n" + "\n".join(unknown)


def test_every_family_of_the_table_has_documented_commands():
    counts = {f.name: len(_of(f.name)) for f in FAMILIES}
    assert all(counts.values()), f"families no page has a command of: {counts}"
    assert counts["train.py"] > 40 and counts["check_upstream LIBRARY"] >= 7
    assert {f.how for f in FAMILIES} == {COMPOSED, RUN, PARSED, SKIPPED}
    assert all(len(f.why) > 20 for f in FAMILIES), "each family says how, or why not"


def test_a_command_of_an_unknown_family_is_caught():
    page = "```bash\ncurl -sSL https://example.com/install.sh | sh   # exit 0\n```\n"
    (command,) = commands(page)
    assert command.entry == "curl" and family_of(command) is None


def test_commands_are_found_in_shell_blocks_with_their_variables():
    page = '```bash\nCOMMON="a=1 b=2"\n.venv/bin/python train.py $COMMON c=3  # note\n```\n'
    page += "prose: python train.py not=this\n"
    page += "```console\n$ PYTHONPATH=. python3 -m recipe.compare a --rtol 1  # exits 1\n"
    page += "a line of output, python train.py x=1\n```\n"
    page += "   ```bash\n   torchrun --nnodes=2 \\\n       train.py cp=8\n   ```\n"
    page += "```text\npython train.py not=this\n```\n"
    train, compare, torchrun = commands(page, "p.md")
    assert (train.entry, train.argv, train.comment) == ("python train.py", ["a=1", "b=2", "c=3"],
                                                        "note")  # fmt: skip
    assert (compare.entry, compare.argv, compare.exit_code) == (
        "python -m recipe.compare", ["a", "--rtol", "1"], 1)  # fmt: skip
    assert torchrun.where == "p.md:11" and torchrun.block == "p.md:10"
    assert _overrides(torchrun) == ["cp=8"]
    assert runnable(["RUN_DIR...", "[--rtol", "X]", "[--device", "cpu|cuda]"]) == [
        "outputs/prefix", "outputs/cp1", "--rtol", "1e-5", "--device", "cpu"]  # fmt: skip


# --- documented exit codes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "comment, code",
    [
        ("exit 1: the pre-#6267 positions", 1),
        ("broken copies: must exit 1", 1),
        ("exits 2 on a bad folder", 2),
        ("one folder per finding", None),
    ],
)
def test_an_exit_code_is_read_from_the_comment(comment, code):
    (command,) = commands(f"```bash\npython -m recipe.compare a  # {comment}\n```\n")
    assert command.exit_code == code


def test_every_exit_code_the_docs_state_is_read_and_asserted():
    """A comment that speaks of the exit code in a phrasing the parser misses, or states one for
    a command that is not run, fails here instead of going unchecked."""
    stated = [c for c in COMMANDS if re.search(r"\bexit", c.comment)]
    assert [c.where for c in stated if c.exit_code is None] == []
    assert [c.where for c in stated if c not in _of(how=RUN)] == []
    assert len(stated) >= 2


# --- train.py commands: composed ----------------------------------------------------------------


def _overrides(command: Command) -> list[str]:
    """The train.py overrides a composed command passes."""
    words = command.argv
    if command.entry == "python train.py":
        return words
    if command.entry == "make":  # make train [VAR=value ...] ARGS="..."
        args = [w.partition("=")[2] for w in words if w.startswith("ARGS=")]
        return shlex.split(args[0]) if args else []
    script = next(i for i, w in enumerate(words) if w.endswith(("train.py", "train.sbatch")))
    return words[script + 1 :]


def _variants(args: list[str]) -> list[list[str]]:
    """A multirun's sweeps expanded to their first and last combinations (each value of a sweep
    is a separate job; the first and the last cover both ends of every list)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "-m" not in args and "--multirun" not in args:
        return [args]
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for text, override in zip(overrides, parsed):
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
            key = override.get_key_element()
            choices.append([f"{key}={values[0]}", f"{key}={values[-1]}"])
        else:
            choices.append([text])
    combos = [list(combo) for combo in itertools.product(*choices)]
    return [combos[0]] if len(combos) == 1 else [combos[0], combos[-1]]


def _check(args: list[str]) -> None:
    """Compose (Hydra's own overrides included) and validate as the app's start-up does."""
    _composes(tuple(args))


@functools.cache  # the same overrides on several pages are composed once (a failure is not kept)
def _composes(args: tuple[str, ...]) -> None:
    from omegaconf import open_dict

    for variant in _variants(list(args)):
        cfg = compose_config(variant, return_hydra_config=True)
        with open_dict(cfg):
            del cfg["hydra"]
        to_typed(cfg)


def _composed() -> list[Command]:
    return _of(how=COMPOSED)


def test_the_pages_have_commands_to_check():
    composed = [_overrides(c) for c in _composed()]
    assert len(composed) > 40
    assert any("experiment=pr6267_ab" in " ".join(a) for a in composed)


@pytest.mark.parametrize("command", _composed(), ids=_id)
def test_every_train_command_in_the_docs_composes(command):
    from importlib.util import find_spec

    from recipe.launch.compose import CONF_DIR
    from recipe.launch.overrides import check_launcher_plugin, check_override_keys

    args = _overrides(command)
    # train.py refuses a key the schema lacks before Hydra sees it: no documented command may be.
    assert check_override_keys(args, CONF_DIR) is None
    # The submitit launchers are an extra (the slurm and dev extras), absent on the GPU image and
    # in its stand-in (STACK=image); train.py itself refuses such a command with this message.
    plugin = find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    if missing := check_launcher_plugin(args, plugin):
        pytest.skip(missing)
    _check(args)


@pytest.mark.parametrize(
    "args, why",
    [
        (["trainer.max_stepz=3"], "max_stepz"),
        (["cp=3"], "cp"),
        (["-m", "cp=1,2", "mtp.scaling=nope"], "mtp.scaling"),
    ],
)
def test_a_broken_command_is_caught(args, why):
    """The check's negative control: a typo, a missing option, a bad value in a sweep."""
    with pytest.raises(Exception, match=why):
        _check(args)


# --- the proof and comparison tools: run in process ---------------------------------------------


def _check_preprocess(argv, monkeypatch) -> int:
    from recipe.checks.preprocess import main

    return main(argv)


def _mutants(argv, monkeypatch) -> int:
    from recipe.checks import mutants

    quick = tuple(m for m in mutants.MUTANTS if m.name in QUICK_MUTANTS)
    assert len(quick) == len(QUICK_MUTANTS), "QUICK_MUTANTS names mutants of the catalogue"
    monkeypatch.setattr(mutants, "MUTANTS", quick)
    return _check_preprocess(argv, monkeypatch)


def _compare(argv, monkeypatch) -> int:
    from recipe.compare.__main__ import main

    return main(argv)


def _diverge(argv, monkeypatch) -> int:
    from recipe.compare.diverge import main

    return main(argv)


def _script(path: str):
    def run(argv, monkeypatch) -> int:
        monkeypatch.setattr(sys, "argv", [path, *argv])
        monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout first
        try:
            runpy.run_path(str(ROOT / path), run_name="__main__")
        except SystemExit as ended:
            if ended.code is None or isinstance(ended.code, int):
                return ended.code or 0
            return 1  # sys.exit("a message")
        return 0

    return run


RUNNERS = {
    "check_preprocess FUNCTION": _check_preprocess,
    "check_preprocess --mutants": _mutants,
    "compare": _compare,
    "compare.diverge": _diverge,
    "scripts/compare_runs.py": _script("scripts/compare_runs.py"),
}


def run_documented(command: Command, monkeypatch, capsys) -> int:
    """Run a documented command in this process; assert the exit code its comment states, or,
    where it states none, that it is not the bad-input code 2."""
    argv = runnable(command.argv)
    code = RUNNERS[family_of(command).name](argv, monkeypatch)
    out, err = capsys.readouterr()
    said = f"{command.where}: {command.code} (run as {argv}) exited {code}\n"
    said += out[-1500:] + err[-1500:]
    if command.exit_code is None:
        assert isinstance(code, int) and code != 2, said
    else:
        assert code == command.exit_code, f"documented: exit {command.exit_code}; {said}"
    return code


def _tool_blocks() -> list[list[Command]]:
    blocks: dict[str, list[Command]] = {}
    for command in _of(how=RUN):
        if family_of(command).name in RUNNERS:
            blocks.setdefault(command.block, []).append(command)
    return list(blocks.values())


def test_every_run_family_has_a_runner():
    run = {f.name for f in FAMILIES if f.how == RUN}
    assert run == {*RUNNERS, "check_upstream LIBRARY"}


@pytest.mark.parametrize(
    "block", _tool_blocks(), ids=lambda block: f"{block[0].block}: " + "; ".join(
        " ".join([c.entry.split()[-1], *c.argv]) for c in block))  # fmt: skip
def test_every_documented_tool_command_runs(block, tmp_path, monkeypatch, capsys):
    """A block's commands in order in one folder, as pasted into a shell, with the run
    directories they name as fake runs there."""
    monkeypatch.chdir(tmp_path)
    for path, cp in RUN_DIRS.items():
        make_run(tmp_path, path, cp=cp, record_tokens=(1, 3), trace_steps=(1,))
    for command in block:
        run_documented(command, monkeypatch, capsys)


def test_a_wrong_documented_exit_code_fails(tmp_path, monkeypatch, capsys):
    """The negative control: a command whose exit code differs from the one documented, and one
    without a documented code that exits 2 (here: a function of another signature)."""
    monkeypatch.chdir(tmp_path)
    spec = "tests.helpers.faulty_preprocess:takes_no_rank"
    line = f".venv/bin/python -m recipe.check_preprocess {spec}"
    (right,) = commands(f"```bash\n{line}  # exit 2: another signature\n```\n")
    assert run_documented(right, monkeypatch, capsys) == 2
    for comment in ("# must exit 0", "# exits 1", ""):
        (wrong,) = commands(f"```bash\n{line}  {comment}\n```\n")
        with pytest.raises(AssertionError, match="exited 2"):
            run_documented(wrong, monkeypatch, capsys)


# --- check_upstream: the releases' own files ----------------------------------------------------


def _first_draws(strategy, case_mismatch, cases: int, seed: int):
    """recipe.checks.search.search on its first UPSTREAM_DRAWS cases, without shrinking."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    found, ran = [], 0

    @hypothesis_seed(seed)
    @settings(max_examples=min(cases, UPSTREAM_DRAWS), phases=[Phase.generate], deadline=None,
              database=None, suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip
    @given(strategy)
    def one_case(case):
        nonlocal ran
        ran += 1
        if (finding := case_mismatch(case)) is not None:
            found.append(finding)
            raise _Found

    try:
        one_case()
    except _Found:
        return found[0], ran
    return None, ran


class _Found(Exception):
    pass


@pytest.mark.launches  # fetches the releases' wheels into the cache (once)
@pytest.mark.parametrize("command", _of("check_upstream LIBRARY"), ids=_id)
def test_every_check_upstream_command_in_the_docs_runs(command, tmp_path, monkeypatch):
    """With a documented exit code: that code, from the releases' real findings on the first
    draws (see FAMILIES). Without one: past everything that exits 2 (the library, release,
    functions, options and report folder it names are real), the search stubbed to find
    nothing (what the full search finds is tests/test_upstream*.py's)."""
    from recipe.checks.upstream import runner
    from recipe.checks.upstream.cli import main

    monkeypatch.chdir(tmp_path)  # `--report reports/` writes beside the command
    if command.exit_code is None:
        monkeypatch.setattr(runner, "check_mode", lambda checked, title, *a, **k: runner.ModeResult(
            title, 0, 0.0, []))  # fmt: skip
        monkeypatch.setattr(runner, "roll_results", lambda kinds, *a: iter(()))
        assert main(command.argv) == 0
        return
    monkeypatch.setattr(runner, "search", _first_draws)
    code = main(command.argv)
    assert code == command.exit_code, f"{command.where}: documented exit {command.exit_code}"


# --- parsed, and the names the commands that are not run rely on --------------------------------


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("command", _of(how=PARSED), ids=_id)
def test_every_documented_script_parses_its_arguments(command, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put the checkout first
    script = runpy.run_path(str(ROOT / command.entry.split()[-1]), run_name="docs")
    argv = runnable(command.argv)
    try:
        if "parse_args" in script:
            args = script["parse_args"](argv)
        else:  # main parses, then works: stop it there
            real = argparse.ArgumentParser.parse_args

            def parse_then_stop(parser, *a, **k):
                raise _Parsed(real(parser, *a, **k))

            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
            with pytest.raises(_Parsed) as parsed:
                script["main"](argv)
            args = parsed.value.args[0]
    except SystemExit as refused:
        pytest.fail(f"{command.where}: {argv} refused (exit {refused.code})")
    if getattr(args, "overrides", None):
        _check(args.overrides)


def test_the_targets_extras_and_files_the_commands_name_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*(?: [a-z][\w-]*)*):", makefile, re.M))
    targets = {t for line in targets for t in line.split()}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(extras["optional-dependencies"])
    for command in COMMANDS:
        if command.entry == "make":
            assert command.argv[0] in targets, f"{command.where}: no make target {command.argv[0]}"
        if command.entry == "pip":
            for named in re.findall(r"\.\[([\w,-]+)\]", command.code):
                assert set(named.split(",")) <= extras, f"{command.where}: extras {named}"
        for word in (command.entry.split()[-1], *command.argv):
            if re.fullmatch(r"(scripts|benchmarks)/[\w/.-]+|train\.py", word):
                assert (ROOT / word).is_file(), f"{command.where}: {word} does not exist"


# --- the configuration reference ----------------------------------------------------------------


def test_the_configuration_reference_is_current():
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/configuration-reference.md is stale: run `python -m recipe.config.reference`"
    )
    assert config_reference.main(["--check"]) == 0


def test_a_field_without_a_docstring_is_refused():
    @dataclasses.dataclass
    class Group:
        documented: int = 1
        """Has one."""
        bare: int = 2

    missing: list[str] = []
    rows = config_reference.rows(Group, "group.", missing)
    assert rows[0] == ("group.documented", "`1`", "Has one.")
    assert missing == ["Group.bare"]
