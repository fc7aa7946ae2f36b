"""`python -m recipe.check_upstream`'s command line: one library (`recipe.checks.upstream`) or
`--all` (`recipe.checks.upstream.table`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe.checks.arguments import at_least
from recipe.checks.upstream.registry import known
from recipe.checks.upstream.runner import parse_fixed, run
from recipe.checks.upstream.table import main_all
from recipe.log import quiet_libraries
from recipe.upstream.source import UpstreamUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.check_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "library", nargs="?", help=f"one of {known()}, optionally @VERSION (or --all)"
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
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="write each finding as a folder ready to file upstream: README.md "
                        "and a standalone reproduce.py")  # fmt: skip
    parser.add_argument("--all", action="store_true",
                        help="every library and release in the registry, one table (JSON and "
                        "markdown in --out)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("outputs/upstream"), metavar="DIR",
                        help="where --all writes upstream.json and upstream.md "
                        "(outputs/upstream)")  # fmt: skip
    parser.add_argument("--write-docs", action="store_true",
                        help="with --all: also regenerate docs/upstream.json and the table in "
                        "docs/upstream.md")  # fmt: skip
    args = parser.parse_args(argv)
    quiet_libraries()
    if args.all == bool(args.library):
        parser.error("name one LIBRARY[@VERSION], or --all (not both)")
    if args.write_docs and not args.all:
        parser.error("--write-docs regenerates the --all table: add --all")
    if args.all and (args.function or args.fixed or args.control or args.report):
        parser.error("--all checks every function at its defaults and drawn: drop --function, "
                     "--fixed, --control and --report (run one library for those)")  # fmt: skip
    try:
        if args.all:
            return main_all(args.cases, args.seed, args.out, args.write_docs)
        return run(args.library, args.function, args.cases, args.seed, parse_fixed(args.fixed),
                   args.control, args.min_length, args.report)  # fmt: skip
    except UpstreamUnavailable as err:
        print(f"check_upstream: {args.library or '--all'}: {err}", file=sys.stderr)
        return 2
