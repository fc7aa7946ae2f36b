"""`.hydra/` of a run directory: the job's config as Hydra composed it, written and read back.

Hydra's own copy is off (hydra.output_subdir=null): it would rewrite the files of the run a
refused job found in its directory. The launcher writes them here once the job is accepted, and
the comparison reads `config.yaml` to tell runs apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from recipe.rundir.layout import CONFIG_FILE, HYDRA_FILE, OVERRIDES_FILE, config_path, hydra_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig


def write_job_files(output_dir: str, cfg: DictConfig, hydra_cfg) -> None:
    """`.hydra/` (config.yaml, hydra.yaml, overrides.yaml) as Hydra writes it, but only once the
    job is accepted: Hydra's own copy is off (hydra.output_subdir=null), since it would rewrite
    the files of the run a refused job found in its directory."""
    from omegaconf import OmegaConf

    folder = hydra_dir(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / CONFIG_FILE)
    OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), folder / HYDRA_FILE)
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), folder / OVERRIDES_FILE)


def read_job_config(run_dir: str | Path) -> dict | None:
    """The run's composed config as plain containers, unresolved; None when the run has no
    `.hydra/config.yaml`."""
    path = config_path(run_dir)
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def read_job_overrides(run_dir: str | Path) -> list[str]:
    """The command-line overrides the job was composed with (`key=value`), [] when unrecorded."""
    path = hydra_dir(run_dir) / OVERRIDES_FILE
    if not path.exists():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.to_container(OmegaConf.load(path))]
