"""hydra/sweeper=catalogue: Hydra's basic sweeper, less the jobs a mutant catalogue never needs.

`experiment=training_mutants` sweeps `mutant.name` x `cp` x `mutant.onset`; of that product it
keeps the correct runs (`mutant.name=none`, onset 1) at every cp, cp=1 among them (the baseline),
and the mutants at cp > 1 only (most mutants are the identity at cp=1, where they would be
"missed" by construction). The baseline runs first, so its anchors exist for every later job.

A mutant from a late onset K trains steps 1..K-1 exactly as the correct run of its cp does (the
mutant is off until K, and training is deterministic): instead of training them again it resumes
from that run's checkpoint of step K-1 (`trainer.resume`, into its own directory, which gets the
checkpoint's records: the whole curve). The correct runs write those checkpoints
(`trainer.checkpoint_every`, the greatest common divisor of the K-1, and enough
`trainer.checkpoint_keep`); they run first, one after another: the basic launcher only (a
launcher that starts the jobs at once trains every mutant from step 1). At onsets 1 and 451 of
500 steps this skips 90% of the late half of the catalogue's training.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore


@dataclass
class CatalogueSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.recipe_launchers.catalogue_sweeper.CatalogueSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="catalogue", node=CatalogueSweeperConf, provider="recipe"
)


def catalogue_job(overrides, first_onset: str = "1") -> bool:
    """Whether a job of the product belongs to the catalogue's sweep: a correct run once per
    cp (at the sweep's first onset, which it does not use), a mutant at cp > 1."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    mutant = values.get("mutant.name", "none")
    cp = values.get("cp", "1").strip("'\"")
    if mutant == "none":
        return values.get("mutant.onset", "1") == first_onset
    return cp != "1"


def _order(overrides) -> tuple:
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    return (values.get("mutant.name", "none") != "none", values.get("cp", "1").strip("'\""))


MUTANT_KEYS = ("mutant.name", "mutant.onset")


def _job(overrides) -> tuple[str, tuple, int]:
    """(mutant, the job's other settings, onset): a mutant forks from the correct run whose
    settings (cp, and anything else swept beside it) are its own."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    values["cp"] = values.get("cp", "1").strip("'\"")
    rest = tuple(sorted((k, v) for k, v in values.items() if k not in MUTANT_KEYS))
    return values.get("mutant.name", "none"), rest, int(values.get("mutant.onset", "1"))


def fork_late_onsets(jobs: list[list[str]], sweep_dir: Path, max_steps: int) -> list[list[str]]:
    """`jobs` in launch order (correct runs first; the job at index i runs in `sweep_dir/i`)
    with each late-onset mutant resuming from the correct run of its settings at the step
    before its onset, and those correct runs keeping the checkpoints. A sweep over
    `trainer.max_steps` is left as it is (its fork points differ by job)."""
    from recipe.rundir.layout import checkpoints_dir, step_name

    given = {o for job in jobs for o in job if o.startswith("trainer.max_steps=")}
    if len(given) > 1:
        return jobs
    parsed = [_job(job) for job in jobs]
    correct = {rest: i for i, (mutant, rest, _) in enumerate(parsed) if mutant == "none"}
    late = {onset - 1 for mutant, rest, onset in parsed if mutant != "none" and rest in correct}
    forks = sorted(step for step in late if 0 < step < max_steps)
    if not forks:
        return jobs
    every = math.gcd(*forks)
    # every fork point up to the last step, and one more: a preemption's own checkpoint
    keep = (max_steps - forks[0]) // every + 3
    forked_from = {
        rest for mutant, rest, onset in parsed if mutant != "none" and onset - 1 in forks
    }
    forked = []
    for job, (mutant, rest, onset) in zip(jobs, parsed):
        if mutant == "none":  # its onset is the sweep's first, which it does not use
            if rest in forked_from:
                job = [*job, f"trainer.checkpoint_every={every}", f"trainer.checkpoint_keep={keep}"]
        elif onset - 1 in forks and rest in correct:
            run = checkpoints_dir(sweep_dir / str(correct[rest]))
            job = [*job, f"trainer.resume={run / step_name(onset - 1)}"]
        forked.append(job)
    return forked


def raise_correct_run_failures(batch: list[list[str]], results) -> None:
    """Raise the error of a correct run (`mutant.name=none`) that failed; a mutant job that
    failed is a catch, which the report counts, so it does not end the sweep."""
    from hydra.core.utils import JobStatus

    for overrides, result in zip(batch, results, strict=True):
        if result.status == JobStatus.FAILED and _job(overrides)[0] != "none":
            continue
        _ = result.return_value  # a failed job's return_value raises its error


class CatalogueSweeper(BasicSweeper):
    def sweep(self, arguments):
        """The basic sweeper's loop, except that a mutant job that failed (a crash is a catch,
        which the report counts) does not fail the sweep: its exit follows the score and the
        correct runs (the report's callback), a correct run's own failure still raises."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        parsed = parser.parse_overrides([*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(parsed, self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, first = [], 0
        for batch in self.overrides:
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=first)
            raise_correct_run_failures(batch, results)
            first += len(batch)
            returns.append(results)
        return returns

    def split_arguments(self, overrides, max_batch_size):
        jobs = [job for batch in super().split_arguments(overrides, None) for job in batch]
        onsets = [
            dict(o.split("=", 1) for o in job if "=" in o).get("mutant.onset", "1") for job in jobs
        ]
        first = min(onsets, key=int) if onsets else "1"
        kept = sorted((job for job in jobs if catalogue_job(job, first)), key=_order)
        if "BasicLauncher" in str(self.config.hydra.launcher.get("_target_", "")):
            # the forks need the correct runs finished first: jobs run one after another
            kept = fork_late_onsets(
                kept, Path(self.config.hydra.sweep.dir), int(self.config.trainer.max_steps)
            )
        size = max_batch_size or len(kept) or 1
        return [kept[i : i + size] for i in range(0, len(kept), size)]
