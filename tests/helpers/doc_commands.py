"""The commands of the docs' shell blocks, as a reader would type them: what runs (the program, a
Python script or `python -m MODULE`), its arguments with the block's variables expanded, and the
exit code its comment states (`# exit 1: ...`, `# broken copies: must exit 1`, `# exits 2`)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
ASSIGN = re.compile(r"^([A-Z_]+)=\"(.*)\"$")
EXIT = re.compile(r"\bexits?\s+(\d+)\b")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"python(3(\.\d+)?)?")


@dataclass(frozen=True)
class Command:
    where: str
    """page:line of its first line"""
    block: str
    """page:line of its block's fence: a block's commands run in order, in one folder"""
    code: str
    """as written, continuation lines joined, the comment dropped"""
    comment: str
    words: tuple[str, ...]
    """`code` split as the shell splits it, the block's variables expanded"""

    @property
    def entry(self) -> str:
        return entry(self.words)[0]

    @property
    def argv(self) -> list[str]:
        """The words after the entry: a script's or module's arguments, a program's."""
        return list(self.words[entry(self.words)[1] :])

    @property
    def exit_code(self) -> int | None:
        """The exit code the comment states, or None."""
        found = EXIT.search(self.comment)
        return int(found[1]) if found else None


def entry(words) -> tuple[str, int]:
    """(what runs, where its arguments start): `python train.py`, `python -m recipe.compare`,
    `make`, `scripts/gpu_kit.sh`, ... past leading VAR=value words and `set ...;`, with any Python
    interpreter (`.venv/bin/python`, `python3`) spelled `python`."""
    words, i = list(words), 0
    while i < len(words):
        if ENV.match(words[i]):
            i += 1
        elif words[i] == "set":
            while i < len(words) and not words[i].endswith(";"):
                i += 1
            i += 1
        else:
            break
    if i >= len(words):
        return "", i
    if not PYTHON.fullmatch(Path(words[i]).name):
        return words[i], i + 1
    if words[i + 1 : i + 2] == ["-m"] and i + 2 < len(words):
        return f"python -m {words[i + 2]}", i + 3
    if i + 1 < len(words):
        return f"python {words[i + 1]}", i + 2
    return "python", i + 1


def shell_blocks(text: str) -> list[tuple[int, str, list[tuple[int, str]]]]:
    """(fence line, language, [(line number, line)]) of each fenced code block marked as shell
    (```bash, ```sh, ```shell, ```console), indented ones (in a list) included."""
    blocks, current = [], None
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.strip()
        if not fence.startswith("```"):
            if current is not None:
                current[2].append((number, line))
            continue
        if current is None:
            current = (number, fence[3:].strip(), [])
        else:
            if current[1] in SHELL:
                blocks.append(current)
            current = None
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment starts at a `#` outside quotes that begins a
    word."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def commands(text: str, page: str = "page") -> list[Command]:
    """Every command of the page's shell blocks. In a console block only the `$ ` lines are
    commands (the rest is their output); a line ending in `\\` continues on the next; an
    assignment (`COMMON="..."`) is expanded into the later commands of its block."""
    found = []
    for fence, language, lines in shell_blocks(text):
        variables, pending = {}, None
        for number, line in lines:
            line = line.strip()
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            code, comment = split_comment(line)
            if pending is not None:
                start, code = pending[0], f"{pending[1]} {code}"
            else:
                start = number
            if code.endswith("\\"):
                pending = (start, code[:-1].rstrip())
                continue
            pending = None
            if not code:
                continue
            if match := ASSIGN.match(code):
                variables[match[1]] = match[2]
                continue
            for name, value in variables.items():
                code = code.replace(f"${name}", value)
            words = tuple(shlex.split(code))
            found.append(Command(f"{page}:{start}", f"{page}:{fence}", code, comment, words))
    return found


def documented_commands() -> list[Command]:
    return [
        command
        for path in PAGES
        for command in commands(path.read_text(), str(path.relative_to(ROOT)))
    ]
