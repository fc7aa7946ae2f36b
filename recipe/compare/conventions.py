"""The conventions table: does each framework's way of calling megatron-core train the cp=1 model?

A sweep over `convention` (conf/convention/) and layouts (experiment=conventions) judges every job
against cp=1 of the same convention, as every parity report does (`diff.compare_all`, rtol on
every step). This module turns those comparisons into one row per convention and layout: the
verdict, how far the run drifted (the worst relative difference of each loss, and at which step),
and, where it differs, the convention's choices that act at that layout, each with the upstream
file:line the run's own config cites (`convention.sources`). Choices are matched to layouts by
`ACTING`, what the recipe knows about megatron-core: which setting changes the trained model only
at which layouts. A PASS row names its control: a row of the same layout that FAILS, which shows
the comparison can tell a convention apart there.

The sweep's callback writes `conventions.md` beside `parity_report.md` when a sweep trains a
framework's convention (`uses_conventions`); `python -m recipe.compare.conventions SWEEP_DIR...
--write-docs` also refreshes the tables in docs/conventions.md, one per sweep (`sweep_tables`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe.compare.diff import Comparison, compare_all
from recipe.compare.jobs import recorded_jobs
from recipe.compare.runs import Run, find_runs, flatten_config
from recipe.names import FP32_RTOL
from recipe.rundir.job_files import read_job_config, read_job_overrides

CONVENTIONS_FILE = "conventions.md"
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "conventions.md"
BEGIN = "<!-- BEGIN conventions table: python -m recipe.compare.conventions SWEEP --write-docs -->"
END = "<!-- END conventions table -->"
LOSSES = ("lm_loss", "mtp_loss")


def _int(run: Run, key: str, default: int = 1) -> int:
    value = run.config.get(key)
    return default if value is None else int(value)


def _on(run: Run, key: str) -> bool:
    return str(run.config.get(key)).lower() == "true"


@dataclass(frozen=True)
class Acting:
    """A setting whose effect on the trained model depends on the layout."""

    key: str
    differs: Callable[[Run], bool]
    """The run's value is not the recipe's."""
    acts: Callable[[Run], bool]
    """At this run's layout the choice changes what is trained (compared with cp=1)."""
    how: str
    """Why, in megatron-core's terms."""
    megatron: str = ""
    """The megatron-core line that makes the setting matter (tests/test_conventions_upstream.py
    reads it from the wheel), shown where the convention cites nothing for the key (the
    recipe's own settings turned off)."""


def _cp(run: Run) -> int:
    return _int(run, "cp.size")


def _splits_tokens(run: Run) -> bool:
    """Tokens of a step are spread over more than one rank of a data or context group."""
    return _cp(run) * _int(run, "parallel.dp") > 1


ACTING: tuple[Acting, ...] = (
    Acting(
        "convention.cu_seqlens_q",
        lambda r: r.config.get("convention.cu_seqlens_q") == "real",
        lambda r: _on(r, "mtp.enabled") and _cp(r) > 1,
        "megatron-core's MTP roll slices each rank's slots at cu_seqlens_q // cp, which is the "
        "zigzag layout only for padded offsets",
        "megatron-core==0.19.2 megatron/core/transformer/multi_token_prediction.py:249",
    ),
    Acting(
        "convention.mtp_loss_mask",
        lambda r: r.config.get("convention.mtp_loss_mask") == "all_ones",
        lambda r: _on(r, "mtp.enabled") and _cp(r) * _int(r, "parallel.tp") > 1,
        "the MTP loss counts padding, whose amount is set by the 2*cp*tp alignment",
        "megatron-core==0.19.2 megatron/core/transformer/multi_token_prediction.py:825-826",
    ),
    Acting(
        "mtp.scaling",
        lambda r: r.config.get("mtp.scaling") == "upstream",
        lambda r: _on(r, "mtp.enabled") and _splits_tokens(r),
        "megatron-core weighs each rank's MTP loss by its own token counts",
        "megatron-core==0.19.2 megatron/core/transformer/multi_token_prediction.py:876-886",
    ),
    Acting(
        "trainer.megatron.calculate_per_token_loss",
        lambda r: str(r.config.get("trainer.megatron.calculate_per_token_loss")).lower() == "false",
        _splits_tokens,
        "each rank's loss is divided by its own token count, then averaged over dp x cp ranks",
        "megatron-core==0.19.2 megatron/core/pipeline_parallel/schedules.py:331-335",
    ),
    Acting(
        "trainer.megatron.sync_mtp_position_embeddings",
        lambda r: (
            str(r.config.get("trainer.megatron.sync_mtp_position_embeddings")).lower() == "false"
        ),
        lambda r: (
            _on(r, "mtp.enabled")
            and _int(r, "parallel.pp") > 1
            and r.config.get("model.position_embedding_type") == "learned_absolute"
        ),
        "the last stage's MTP copy of the position embeddings is in no gradient group with "
        "the first stage's",
        "megatron-core==0.19.2 megatron/core/parallel_state.py:569-572",
    ),
    Acting(
        "cp.preprocess",
        lambda r: r.config.get("cp.preprocess") not in (None, "index"),
        lambda r: _cp(r) > 1,
        "each rank's tokens, positions and labels come from the framework's own function",
    ),
)


def sources_of(run: Run) -> list[dict]:
    """The convention's choices with their upstream file:line, as the run's config holds them."""
    raw = run.config.get("convention.sources")
    if raw is None:
        return []
    return json.loads(raw) if isinstance(raw, str) else list(raw)


def acting_choices(run: Run) -> list[tuple[Acting, list[dict]]]:
    """The run's settings that differ from the recipe's and act at its layout, each with the
    convention's sources that name it."""
    sources = sources_of(run)
    found = []
    for acting in ACTING:
        if acting.differs(run) and acting.acts(run):
            cited = [s for s in sources if acting.key in s.get("keys", [])]
            found.append((acting, cited))
    return found


def layout_label(run: Run) -> str:
    parts = [f"cp={_cp(run)}"]
    for key, name in (("parallel.pp", "pp"), ("parallel.tp", "tp"), ("parallel.dp", "dp")):
        if _int(run, key) > 1:
            parts.append(f"{name}={_int(run, key)}")
    parts.append("mtp=on" if _on(run, "mtp.enabled") else "mtp=off")
    return " ".join(parts)


def _drift(c: Comparison) -> str:
    shown = []
    for d in c.diffs:
        if d.metric in LOSSES and d.max_rel is not None:
            shown.append(f"{d.metric} {d.max_rel:.1e} (step {d.worst_step})")
    return ", ".join(shown) or "-"


def _why(run: Run) -> str:
    lines = []
    for acting, cited in acting_choices(run):
        places = [s["where"] for s in cited if s.get("where")] or [acting.megatron]
        where = "; ".join(f"`{p}`" for p in places if p) or "no source cited"
        lines.append(f"`{acting.key}`: {acting.how} [{where}]")
    return "<br>".join(lines) or "-"


# Overrides that a row's convention and layout columns already say, or that change nothing
# trained: the others (an ablation's, e.g. mtp.scaling=exact) are shown with the convention.
_SHOWN_ELSEWHERE = (
    "convention=",
    "cp=",
    "mtp=",
    "experiment=",
    "parallel.",
    "trainer.progress_bar",
)


def convention_label(run: Run) -> str:
    """The convention's name, with the job's other overrides: an ablation sweep (a convention
    with one choice set back to the recipe's) gets rows of its own."""
    name = str(run.config.get("convention.name", "recipe"))
    extra = [
        o
        for o in read_job_overrides(run.path)
        if not o.startswith(_SHOWN_ELSEWHERE) and not o.startswith(("hydra.", "+hydra."))
    ]
    return " ".join([name, *extra])


@dataclass
class Row:
    convention: str
    layout: str
    verdict: str
    drift: str
    why: str
    control: str = ""
    job: int = 0
    """The job's number in its sweep: conventions are listed in the order the sweep ran them."""


def _job_number(run: Run) -> int:
    return int(run.path.name) if run.path.name.isdigit() else 0


def failed_run(path: Path, error: str) -> Row | None:
    """The row of a job that ended with an error before it could be compared (None when its
    config is gone): megatron raising on a convention's inputs is a verdict too."""
    config = read_job_config(path)
    if config is None:
        return None
    run = Run(Path(path), [], flatten_config(config))
    return Row(
        convention_label(run),
        layout_label(run),
        "**RAISES**",
        f"`{error}`",
        _why(run) if acting_choices(run) else "read the job's train.log",
        job=_job_number(run),
    )


def table_rows(comparisons: list[Comparison], failed: list[tuple[Path, str]] = ()) -> list[Row]:
    """One row per run that has a baseline, and one per job that raised; conventions in
    first-seen order, then layouts."""
    rows: list[Row] = [row for row in (failed_run(p, e) for p, e in failed) if row is not None]
    raised = {Path(p).resolve() for p, _ in failed}
    for c in comparisons:
        # a layout that is a baseline's own (cp=1 beside another cp=1 that differs only in how
        # its tokens are split, e.g. cp.preprocess) says nothing about CP
        if c.baseline is None or c.run.is_reference_layout or c.run.path.resolve() in raised:
            continue
        run = c.run
        verdict = "PASS" if c.passed else "**FAIL**"
        why = _why(run) if not c.passed else "-"
        if not c.passed and why == "-":
            why = "no choice of this convention is known to act here: read the parity report"
        rows.append(
            Row(
                convention_label(run),
                layout_label(run),
                verdict,
                _drift(c),
                why,
                job=_job_number(run),
            )
        )
    for row in rows:
        if row.verdict == "PASS":
            controls = sorted(
                {r.convention for r in rows if r.layout == row.layout and r.verdict != "PASS"}
            )
            shown = ", ".join(f"`{name}`" for name in controls[:2])
            more = f" (+{len(controls) - 2} more)" if len(controls) > 2 else ""
            row.control = shown + more if controls else "none at this layout"
    first_job: dict[str, int] = {}
    for row in rows:
        first_job[row.convention] = min(row.job, first_job.get(row.convention, row.job))
    return sorted(rows, key=lambda r: (first_job[r.convention], r.layout))


def render(rows: list[Row], rtol: float) -> str:
    header = (
        "| convention | layout | verdict vs cp=1 | worst relative difference | "
        "what acts here (upstream file:line) | control (FAILS at this layout) |\n"
        "|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r.convention} | {r.layout} | {r.verdict} | {r.drift} | {r.why} | "
        f"{r.control or '-'} |\n"
        for r in rows
    )
    note = (
        f"\nEach job against cp=1 of the same convention and mtp setting, rtol {rtol:g} on every "
        "step of lm_loss, mtp_loss and grad_norm.\n"
    )
    return header + body + note


def choices_table(runs: list[Run]) -> str:
    """Each convention's choices and the upstream lines that make them, as its runs cite them."""
    seen: dict[str, list[dict]] = {}
    for run in runs:
        seen.setdefault(str(run.config.get("convention.name", "recipe")), sources_of(run))
    lines = ["| convention | choice | recipe settings | upstream |", "|---|---|---|---|"]
    for name, sources in seen.items():
        if not sources:
            lines.append(f"| {name} | the recipe's own (docs/architecture.md) | defaults | - |")
        for s in sources:
            keys = ", ".join(f"`{k}`" for k in s.get("keys", []))
            lines.append(f"| {name} | {s['choice']} | {keys} | `{s.get('where', '')}` |")
    return "\n".join(lines) + "\n"


def sweep_tables(
    sweeps: list[tuple[str, list[Run], list[tuple[Path, str]]]], rtol: float = FP32_RTOL
) -> str:
    """One table per sweep (its name, its runs, the (directory, error) of its jobs that raised),
    then each convention's choices with their upstream lines, once for all the sweeps."""
    sections, every_run = [], []
    for name, runs, failed in sweeps:
        every_run += runs
        rows = table_rows(compare_all(runs, rtol), failed)
        sections.append(f"#### {name}\n\n{render(rows, rtol)}")
    choices = f"#### The choices each convention makes\n\n{choices_table(every_run)}"
    return "\n".join([*sections, choices])


def uses_conventions(runs: list[Run]) -> bool:
    """A sweep over conventions, or over one framework's convention (an ablation): the sweeps
    whose parity report gets a conventions table beside it."""
    names = {r.config.get("convention.name") for r in runs}
    return len(names) > 1 or bool(names - {"recipe", None})


def write_docs(table: str, page: Path = DOCS_PAGE) -> None:
    """Replace the table between the markers of the docs page."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{page} has no {BEGIN!r} ... {END!r} block to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe.compare.conventions",
        description="The conventions table of a sweep over convention x layout.",
    )
    parser.add_argument(
        "paths", nargs="+", help="sweep directories: one table each, under the folder's name"
    )
    parser.add_argument("--rtol", type=float, default=FP32_RTOL)
    parser.add_argument(
        "--write-docs", action="store_true", help=f"also refresh the table in {DOCS_PAGE.name}"
    )
    args = parser.parse_args(argv)
    sweeps = [(p.name, find_runs([p]), recorded_jobs(p)[1]) for p in map(Path, args.paths)]
    table = sweep_tables(sweeps, args.rtol)
    print(table)
    if args.write_docs:
        write_docs(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
