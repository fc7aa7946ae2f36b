"""The docs say what the code does: the configuration reference is generated from the schema and
current, and every `python train.py ...` command in README.md and docs/ composes and validates as
written (the same composition and typed checks as the app's start-up, without training)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path

import pytest

from recipe.config import reference as config_reference
from recipe.launch.compose import compose_config, to_typed

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ASSIGN = re.compile(r"^([A-Z_]+)=\"(.*)\"$")


def shell_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block marked as shell (```bash, ```sh, ```console)."""
    blocks, current, shell = [], None, False
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if current is None:
                current, shell = [], fence[3:].strip() in ("bash", "sh", "console")
            else:
                if shell:
                    blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def train_commands(text: str) -> list[list[str]]:
    """The argument lists of every `train.py` command in the page's shell code blocks, with the
    shell variables the block assigns expanded and trailing comments dropped."""
    found = []
    for block in shell_blocks(text):
        variables = {}
        for line in block:
            line = line.strip()
            if match := ASSIGN.match(line):
                variables[match[1]] = match[2]
                continue
            if "train.py" not in line or line.startswith("#"):
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            words = shlex.split(line, comments=True)
            found.append(words[words.index("train.py") + 1 :])
    return found


def module_commands(text: str, module: str) -> list[list[str]]:
    """The argument lists of every `python -m MODULE ...` command in the page's shell blocks."""
    found = []
    for block in shell_blocks(text):
        for line in block:
            words = shlex.split(line.strip(), comments=True) if module in line else []
            if words[:1] != ["#"] and module in words and words[words.index(module) - 1] == "-m":
                found.append(words[words.index(module) + 1 :])
    return found


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
    from omegaconf import open_dict

    for variant in _variants(args):
        cfg = compose_config(variant, return_hydra_config=True)
        with open_dict(cfg):
            del cfg["hydra"]
        to_typed(cfg)


def _all_commands() -> list[tuple[str, list[str]]]:
    return [
        (f"{page.relative_to(ROOT)}: train.py {' '.join(args)}", args)
        for page in PAGES
        for args in train_commands(page.read_text())
    ]


def test_the_pages_have_commands_to_check():
    commands = _all_commands()
    assert len(commands) > 40
    assert any("experiment=pr6267_ab" in " ".join(a) for _, a in commands)


@pytest.mark.parametrize(
    "where, args", _all_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_train_command_in_the_docs_composes(where, args):
    from importlib.util import find_spec

    from recipe.launch.compose import CONF_DIR
    from recipe.launch.overrides import check_launcher_plugin, check_override_keys

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


def _upstream_commands() -> list[tuple[str, list[str]]]:
    return [
        (f"{page.relative_to(ROOT)}: check_upstream {' '.join(args)}", args)
        for page in PAGES
        for args in module_commands(page.read_text(), "recipe.check_upstream")
        if "--all" not in args  # every library: the table's own test and docs/upstream.json
    ]


@pytest.mark.launches  # fetches the releases' wheels into the cache (once)
@pytest.mark.parametrize(
    "where, args", _upstream_commands(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_check_upstream_command_in_the_docs_runs(where, args, tmp_path, monkeypatch):
    """Each documented command gets past everything that exits 2 (the library, release,
    functions, options and report folder it names are real); the search itself is stood in
    for, as tests/test_upstream*.py run it with the documented exit codes."""
    from recipe.checks.upstream import runner
    from recipe.checks.upstream.cli import main

    monkeypatch.chdir(tmp_path)  # `--report reports/` writes beside the command
    monkeypatch.setattr(runner, "check_mode", lambda checked, title, *a, **k: runner.ModeResult(
        title, 0, 0.0, []))  # fmt: skip
    monkeypatch.setattr(runner, "roll_results", lambda kinds, *a: iter(()))
    assert main(args) == 0


def test_commands_are_found_in_shell_blocks_with_their_variables():
    page = '```bash\nCOMMON="a=1 b=2"\n.venv/bin/python train.py $COMMON c=3  # note\n```\n'
    page += "prose: python train.py not=this\n"
    assert train_commands(page) == [["a=1", "b=2", "c=3"]]
    page = "```bash\n.venv/bin/python -m recipe.check_upstream verl@0.7.1  # exit 1\n```\n"
    assert module_commands(page, "recipe.check_upstream") == [["verl@0.7.1"]]
    assert len(_upstream_commands()) >= 7


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
