"""Compare training runs step by step and gate on the result.

    python -m recipe.compare RUN_DIR... [--baseline RUN_DIR] [--rtol X] [--plot FILE]
                             [--per-token [--token-atol X]]

RUN_DIR is a run directory (it holds metrics.jsonl) or a sweep directory (its runs are used).
Without --baseline each run is compared with the cp=1 run that has otherwise the same settings.
Prints the parity table; exits 0 when every compared run passes, 1 when any fails (or nothing
could be compared), 2 on bad arguments. With --per-token, the runs' per-token records
(trainer.record_tokens) are compared too, token by token, and a token beyond --token-atol fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe.compare.diff import all_passed
from recipe.compare.golden import export_golden, load_golden
from recipe.compare.judge import judge
from recipe.compare.plot import plot_comparisons
from recipe.compare.report import render_markdown
from recipe.compare.runs import find_runs, load_run
from recipe.compare.tokens import compare_records, compare_token_records, render_token_report
from recipe.errors import RecipeError
from recipe.names import FP32_RTOL, FP32_TOKEN_ATOL, NOISE_FLOORS, NOISE_MARGIN
from recipe.rundir.tokens import read_token_records


def main(argv: list[str] | None = None) -> int:
    prog = None if Path(sys.argv[0]).name != "__main__.py" else "python -m recipe.compare"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run or sweep directories")
    parser.add_argument("--baseline", help="compare every run with this run directory")
    parser.add_argument(
        "--golden", help="compare every run with this stored baseline (see --export-golden)"
    )
    parser.add_argument(
        "--export-golden",
        metavar="FILE",
        help="store the one given run's curves and per-token records in FILE, and exit",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=FP32_RTOL,
        help=f"largest relative difference per step (default {FP32_RTOL:g}, fp32 on CPU; "
        "about 0.05 for bf16 on GPU)",
    )
    parser.add_argument(
        "--noise-floor",
        choices=NOISE_FLOORS,
        default="auto",
        help="auto (default): where a run fails at --rtol, train its baseline's noise twin (the "
        "baseline again with the sequences of each micro-batch reversed, into <baseline>/"
        "noise_twin/, reused next time) and allow --noise-margin times the baseline's own drift "
        "from it at each step; twin: do that for every baseline; fixed: --rtol on every step",
    )
    parser.add_argument(
        "--noise-margin",
        type=float,
        default=NOISE_MARGIN,
        help=f"how many times the baseline's own drift a run may differ by (default "
        f"{NOISE_MARGIN:g})",
    )
    parser.add_argument("--plot", help="write loss curves and differences to this PNG file")
    parser.add_argument("--report", help="also write the table (markdown) to this file")
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="also compare the per-token records (trainer.record_tokens) token by token",
    )
    parser.add_argument(
        "--token-atol",
        type=float,
        default=FP32_TOKEN_ATOL,
        help=f"largest absolute per-token loss difference (default {FP32_TOKEN_ATOL:g}, fp32 "
        "on CPU)",
    )
    args = parser.parse_args(argv)
    golden_tokens = None
    try:
        runs = find_runs(args.runs)
        if args.export_golden:
            if len(runs) != 1:
                raise ValueError(f"--export-golden takes one run; {len(runs)} were found")
            print(f"golden: {export_golden(runs[0].path, args.export_golden)}")
            return 0
        if args.baseline and args.golden:
            raise ValueError("give --baseline or --golden, not both")
        baseline = load_run(args.baseline) if args.baseline else None
        if args.golden:
            baseline, golden_tokens = load_golden(args.golden)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for name in ("rtol", "noise_margin"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            print(f"error: {flag} must be > 0, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if baseline is not None and all(r.path.resolve() != baseline.path.resolve() for r in runs):
        runs = [baseline, *runs]
    floor = "fixed" if golden_tokens is not None else args.noise_floor  # a golden has no twin
    try:
        comparisons = judge(runs, args.rtol, baseline, floor, args.noise_margin)
    except (RecipeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = render_markdown(comparisons, args.rtol)
    tokens_passed = True
    if args.per_token:
        for c in comparisons:
            if c.baseline is None:
                continue
            if golden_tokens is not None and c.baseline is baseline:
                tokens = compare_records(
                    read_token_records(c.run.path),
                    golden_tokens,
                    args.token_atol,
                    c.run.cp or 1,
                    c.run.path,
                    baseline.path,
                )
            else:
                tokens = compare_token_records(
                    c.run.path, c.baseline.path, args.token_atol, c.run.cp or 1
                )
            report += "\n\n" + render_token_report(tokens)
            tokens_passed = tokens_passed and tokens.passed
    print(report)
    if args.report:
        Path(args.report).write_text(report)
    if args.plot:
        plot_comparisons(comparisons, args.plot)
        print(f"plot: {args.plot}")
    if not any(c.passed is not None for c in comparisons):
        print(
            "nothing was compared: no run has a baseline (give --baseline, or include a cp=1 "
            "run with the same settings)",
            file=sys.stderr,
        )
        return 1
    return 0 if all_passed(comparisons) and tokens_passed else 1


if __name__ == "__main__":
    sys.exit(main())
