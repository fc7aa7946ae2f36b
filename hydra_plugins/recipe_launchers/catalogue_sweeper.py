"""hydra/sweeper=catalogue: Hydra's basic sweeper, less the jobs a mutant catalogue never needs.

`experiment=training_mutants` sweeps `mutant.name` x `cp` x `mutant.onset`; of that product it
keeps the correct runs (`mutant.name=none`, onset 1) at every cp, cp=1 among them (the baseline),
and the mutants at cp > 1 only (most mutants are the identity at cp=1, where they would be
"missed" by construction). The baseline runs first, so its anchors exist for every later job.
"""

from dataclasses import dataclass

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


class CatalogueSweeper(BasicSweeper):
    def split_arguments(self, overrides, max_batch_size):
        jobs = [job for batch in super().split_arguments(overrides, None) for job in batch]
        onsets = [
            dict(o.split("=", 1) for o in job if "=" in o).get("mutant.onset", "1") for job in jobs
        ]
        first = min(onsets, key=int) if onsets else "1"
        kept = sorted((job for job in jobs if catalogue_job(job, first)), key=_order)
        size = max_batch_size or len(kept) or 1
        return [kept[i : i + size] for i in range(0, len(kept), size)]
