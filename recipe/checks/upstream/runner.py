"""Check the CP preprocessing functions of a released library against the ground truth:
`python -m recipe.check_upstream LIBRARY[@VERSION] [--function NAME] [--cases N] [--seed S]
[--fixed KEY=VALUE ...] [--min-length N] [--control [function|inverse]]`.

LIBRARY is `verl`, `megatron-bridge` or `megatron-core`; without a version the installed release
is read, with one its wheel is fetched with pip (no dependencies) into a cache. megatron-core's
MTP `roll_tensor` exchanges tokens between CP ranks, so it runs on real gloo ranks (cp 2 and 4)
with the installed release, once per way real callers fill `cu_seqlens_q`. Each function runs
twice: at its default options, then with every option of its signature that changes the layout drawn
(`--fixed` pins one). Micro-batches are drawn as by `recipe.check_preprocess` (cp 2/4/8, tp 1/2);
on a difference hypothesis shrinks the case and the minimal one is printed with the options, the
rank, slot, field, expected and got. A function that raises on a valid input is a finding too.
Functions with a gathering inverse (verl's postprocess_*) also round-trip a per-token tensor on
every case: sharded on every rank and gathered back, it must equal the original.
`--control` runs each function's deliberately broken copy instead, which must be flagged
(`--control inverse`: the gathering function's broken copy, the round trip's control).
A release that lacks one of the library's checked functions (or has one that refuses CP) has
the others checked: the missing one gets a `CANNOT CHECK` line saying why.
Exit 0 = every function checked passed, 1 = a finding, 2 = nothing could be checked (says what
is missing), a count out of range (`--cases` and `--min-length` are 1 or more) or a `--report`
folder that cannot be written (checked before the search).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from recipe.checks.assess import Impact
from recipe.checks.search import search
from recipe.checks.upstream.kit.checked import Checked, Finding
from recipe.checks.upstream.registry import MEGATRON_CORE, REGISTRY, parse_spec
from recipe.upstream.source import UpstreamUnavailable, public_version


@dataclass
class ModeResult:
    """One mode of one function: the cases run and the findings, one per impact class reached,
    worst first."""

    title: str
    ran: int
    seconds: float
    findings: list[Finding]

    @property
    def worst(self) -> Finding | None:
        return self.findings[0] if self.findings else None


def case_finding(checked: Checked, lengths, cp_size, tp_size, options: dict) -> Finding | None:
    """The finding on one (lengths, cp, tp) micro-batch with these options, or None."""
    return checked.finding((tuple(lengths), cp_size, tp_size), options)


def options_strategy(checked: Checked, fixed: dict, drawn: bool):
    from hypothesis import strategies as st

    if not drawn:
        return st.just({k: v for k, v in fixed.items() if k in checked.drawn})
    chosen = {
        name: st.just(fixed[name]) if name in fixed else st.sampled_from(values)
        for name, values in checked.drawn.items()
    }
    return st.fixed_dictionaries(chosen)


def _search(checked: Checked, cases: int, seed: int, fixed: dict, drawn: bool, min_length: int,
            impact: Impact | None = None) -> tuple[Finding | None, int]:  # fmt: skip
    """The minimal finding (of exactly `impact` when given) in `cases` draws, and the count."""
    from hypothesis import strategies as st

    strategy = st.tuples(checked.cases(min_length), options_strategy(checked, fixed, drawn))

    def one(case):
        inner, chosen = case
        found = checked.finding(inner, {k: v for k, v in chosen.items() if v is not None})
        if found is None or (impact is not None and found.impact != impact):
            return None
        return found

    return search(strategy, one, cases, seed)


def check_target(checked: Checked, cases: int, seed: int, fixed: dict, drawn: bool,
                 min_length: int = 1):  # fmt: skip
    """(the first finding, shrunk, or None; cases run) at the defaults or with options drawn."""
    return _search(checked, cases, seed, fixed, drawn, min_length)


def check_mode(checked: Checked, title: str, cases: int, seed: int, fixed: dict, drawn: bool,
               min_length: int = 1) -> ModeResult:  # fmt: skip
    """The first finding, then a search for each worse impact class, worst first, stopping at
    the first it reaches: a finding is reported at its worst, each class with its own minimal
    case, not at the impact of whatever case shrank first."""
    start = time.perf_counter()
    first, ran = _search(checked, cases, seed, fixed, drawn, min_length)
    findings = []
    if first is not None:
        findings.append(first)
        for impact in sorted((i for i in Impact if i > first.impact), reverse=True):
            worse, more = _search(checked, cases, seed, fixed, drawn, min_length, impact)
            ran += more
            if worse is not None:
                findings.insert(0, worse)
                break
    return ModeResult(title, ran, time.perf_counter() - start, findings)


def modes(checked: Checked) -> list[tuple[str, bool]]:
    found = [("default options", False)]
    if checked.drawn:
        found.append((f"options drawn ({', '.join(checked.drawn)})", True))
    return found


def print_mode(result: ModeResult) -> None:
    if result.worst is None:
        print(f"  PASS {result.title}: {result.ran} cases on every rank, {result.seconds:.1f} s")
        return
    print(f"  FAIL {result.title}: worst impact {result.worst.impact.label} ({result.ran} cases, "
          f"{result.seconds:.1f} s); the minimal case of each class reached:")  # fmt: skip
    for finding in result.findings:
        print(f"    {finding.describe()}")


def _value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse_fixed(pairs: list[str]) -> dict:
    fixed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UpstreamUnavailable(
                f"--fixed {pair!r}: write KEY=VALUE, e.g. use_fp8_padding=false"
            )
        fixed[key] = _value(value)
    return fixed


# How real callers fill PackedSeqParams for megatron's MTP roll (recipe/checks/mtp_roll.py).
ROLL_CALLERS = {
    "padded": "cu_seqlens_q = the padded offsets (as verl passes them)",
    "unpadded": "cu_seqlens_q = the real offsets, cu_seqlens_q_padded = the padded ones (as "
    "Megatron-Bridge's packed SFT passes them)",
}


def run_megatron_core(version: str | None, function: str | None, cases: int, seed: int,
                      fixed: dict, control: str | None, min_length: int) -> int:  # fmt: skip
    """megatron-core's MTP roll_tensor on real gloo ranks (cp 2 and 4), once per way real
    callers fill cu_seqlens_q. It runs the installed release: its ranks import megatron."""
    from recipe.upstream.source import installed_version

    installed = installed_version(MEGATRON_CORE)
    if version not in (None, installed):
        raise UpstreamUnavailable(
            f"megatron-core's roll_tensor runs on real ranks with the installed release "
            f"({installed}); to check {version}, install it (`pip install megatron-core=="
            f"{version}`, or make setup STACK=legacy for 0.16.1) and run without @VERSION"
        )
    if function not in (None, "roll_tensor"):
        raise UpstreamUnavailable(
            f"megatron-core has no checked function {function!r}; checked: roll_tensor"
        )
    if control == "inverse" or min_length != 1 or set(fixed) - {"cu_seqlens_q"}:
        raise UpstreamUnavailable(
            "megatron-core's roll_tensor takes only --cases, --seed, --control and --fixed "
            "cu_seqlens_q=padded|unpadded"
        )
    kinds = [fixed["cu_seqlens_q"]] if "cu_seqlens_q" in fixed else list(ROLL_CALLERS)
    if set(kinds) - set(ROLL_CALLERS):
        raise UpstreamUnavailable(f"--fixed cu_seqlens_q: one of {', '.join(ROLL_CALLERS)}")
    broken = " [broken copy: function]" if control else ""
    print(f"megatron-core@{installed} roll_tensor (MTP, THD + CP){broken}: {ROLL_FILE}")
    print("  on real gloo ranks, cp 2 and 4: labels and loss mask rolled on every rank, against "
          "the rolled ground truth")  # fmt: skip
    found = 0
    for kind, finding, ran, took in roll_results(kinds, cases, seed, bool(control)):
        if finding is None:
            print(f"  PASS {ROLL_CALLERS[kind]}: {ran} cases (cp 2 and 4), {took:.1f} s")
            continue
        found += 1
        print(f"  FAIL {ROLL_CALLERS[kind]}: {finding.impact.label} (minimal case, {took:.1f} s):")
        print(f"    {finding.what}")
    return 1 if found else 0


ROLL_FILE = "megatron/core/transformer/multi_token_prediction.py"


def roll_results(kinds, cases: int, seed: int, broken: bool):
    """(caller kind, Finding or None, cases run, seconds) of megatron-core's roll_tensor."""
    from recipe.checks import mtp_roll
    from recipe.launch.local import RanksFailed

    for kind in kinds:
        start = time.perf_counter()
        try:
            mismatch, ran = mtp_roll.check_roll(cases=cases, seed=seed, broken=broken,
                                                cu_kind=kind)  # fmt: skip
        except mtp_roll.PointToPointTimeout as err:  # the ranks did not fail alike: a finding
            mismatch, ran = err, cases
        except RanksFailed as err:
            raise UpstreamUnavailable(f"the checker's ranks failed: {err}") from None
        took = time.perf_counter() - start
        if mismatch is None:
            yield kind, None, ran, took
            continue
        what = mismatch.describe() if hasattr(mismatch, "describe") else str(mismatch)
        # a roll that raises (or leaves a peer waiting) stops training; any other difference
        # trains a real token's MTP loss on a wrong label
        raised = not hasattr(mismatch, "describe") or " raised " in (mismatch.note or "")
        impact = Impact.RAISES if raised else Impact.MISPLACED
        case = {"lengths": list(getattr(mismatch, "lengths", ())),
                "cp": getattr(mismatch, "cp_size", None), "cu_seqlens_q": kind}  # fmt: skip
        yield kind, Finding(case, (("cu_seqlens_q", kind),), impact, what), ran, took


def load_targets(spec: str, function: str | None) -> tuple[list[Checked], dict[str, str]]:
    """The checked functions of `spec` that this release has, and why each other one cannot be
    checked (by name): a release that lacks one family still has its others checked. Raises
    when none can be."""
    library, version = parse_spec(spec)
    entry = REGISTRY[library]
    targets = [t for t in entry.targets if function in (None, t.name)]
    if not targets:
        names = ", ".join(t.name for t in entry.targets)
        raise UpstreamUnavailable(
            f"{library} has no checked function {function!r}; checked: {names}"
        )
    loaded, unavailable = [], {}
    for target in targets:
        try:
            loaded.append(target.load(library, entry.distribution, version))
        except UpstreamUnavailable as err:
            unavailable[target.name] = str(err)
    if not loaded:
        raise UpstreamUnavailable("; ".join(dict.fromkeys(unavailable.values())))  # once each
    return loaded, unavailable


def check_report_folder(report: Path) -> None:
    """`--report DIR` must be a folder this user can write, checked before the search runs (a
    search can take minutes; its findings must not be lost to a bad folder at the end)."""
    if report.exists() and not report.is_dir():
        raise UpstreamUnavailable(
            f"--report {report} is a file; give a folder (created if missing)"
        )
    try:
        report.mkdir(parents=True, exist_ok=True)
        probe = report / ".check_upstream_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UpstreamUnavailable(
            f"--report {report} cannot be written ({err.strerror or err}); give a folder you "
            "can write"
        ) from None


def run(spec: str, function: str | None, cases: int, seed: int, fixed: dict,
        control: str | None, min_length: int = 1, report: Path | None = None) -> int:  # fmt: skip
    library, _, version = spec.partition("@")
    if library == MEGATRON_CORE:
        if report is not None:
            raise UpstreamUnavailable(
                "--report: megatron-core's roll_tensor runs on real ranks; its findings have no "
                "one-process reproducer (tests/test_upstream_roll.py pins them)"
            )
        return run_megatron_core(version or None, function, cases, seed, fixed, control,
                                 min_length)  # fmt: skip
    if report is not None:
        check_report_folder(report)
    loaded_targets, unavailable = load_targets(spec, function)
    for name, why in unavailable.items():
        print(f"CANNOT CHECK {name}: {why}")
    drawn_anywhere = {name for loaded in loaded_targets for name in loaded.drawn}
    unknown = set(fixed) - drawn_anywhere
    if unknown:
        raise UpstreamUnavailable(
            f"--fixed {', '.join(sorted(unknown))}: not a drawn option of {spec}'s checked "
            f"functions (drawn: {', '.join(sorted(drawn_anywhere)) or 'none'})"
        )
    has_inverse = [getattr(loaded, "inverse_name", None) for loaded in loaded_targets]
    if control == "inverse" and not any(has_inverse):
        raise UpstreamUnavailable(
            f"--control inverse: none of {spec}'s checked functions has a gathering inverse"
        )
    found = 0
    for loaded, inverse in zip(loaded_targets, has_inverse, strict=True):
        if control == "inverse" and not inverse:
            print(f"{loaded.label}: no gathering function, no inverse to break (skipped)")
            continue
        line = loaded.line  # the release's: a broken copy's source is not in the file
        if control:
            loaded = loaded.broken_copy(control)
        named = getattr(loaded, "function_name", loaded.name.split(".")[-1])
        alias = "" if named == loaded.name.split(".")[-1] else f" (named {named} in this release)"
        broken = f" [broken copy: {control}]" if control else ""
        print(f"{loaded.label}{alias}{broken}: {loaded.file}:{line}")
        for note in loaded.notes:
            print(f"  {note}")
        for name, why in loaded.skipped.items():
            print(f"  not drawn: {name}: {why}")
        for title, drawn in modes(loaded):
            result = check_mode(loaded, title, cases, seed, fixed, drawn, min_length)
            print_mode(result)
            found += bool(result.findings)
            if report is not None and not control:
                for finding in result.findings:
                    written = write_report(report, loaded, result.title, finding)
                    print(f"    report: {written}")
    return 1 if found else 0


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def write_report(folder: Path, checked: Checked, mode: str, finding: Finding) -> Path:
    """A folder per finding, ready to file upstream: README.md (title, versions, the minimal
    case, the released file:line, the impact) and reproduce.py (torch and the wheel only)."""
    import torch

    mode_tag = "defaults" if mode.startswith("default") else "drawn"
    where = folder / _slug(f"{checked.label}-{mode_tag}-{finding.impact.label}")
    where.mkdir(parents=True, exist_ok=True)
    script = checked.reproducer(finding)
    options = " ".join(f"--fixed {k}={v}" for k, v in finding.options)
    installed = REGISTRY[checked.library].installed_only
    source = "the installed release" if installed else "PyPI wheel"
    install = (
        f"pip install {checked.distribution}=={public_version(checked.version)}  # the script "
        "reads the installed release when it is this version"
        if installed
        else "pip install torch  # and the release's own imports; the script fetches the wheel"
    )
    lines = [
        f"# {checked.label}: {finding.impact.label} ({checked.file}:{checked.line})",
        "",
        f"- release: {checked.distribution} {checked.version} ({source}), file "
        f"`{checked.file}`, function at line {checked.line}",
        f"- checked with: Python {sys.version.split()[0]}, torch {torch.__version__}",
        f"- mode: {mode}",
        f"- impact: **{finding.impact.label}**",
        f"- minimal case: `{json.dumps(finding.case)}`, options: "
        f"`{dict(finding.options) or 'defaults'}`",
        "",
        "## What happens",
        "",
        finding.what,
        "",
        "## Reproduce",
        "",
    ]
    if script is None:
        lines += [
            "No standalone reproducer for this kind of finding; the checker reproduces it:",
            "",
            "```bash",
            f"python -m recipe.check_upstream {checked.library}@{checked.version} --function "
            f"{checked.name} {options}".rstrip(),
            "```",
        ]
    else:
        (where / "reproduce.py").write_text(script)
        lines += [
            "```bash",
            install,
            "python reproduce.py            # exit 1 and the wrong slots: reproduced",
            "```",
        ]
    (where / "README.md").write_text("\n".join(lines) + "\n")
    return where
