"""Every option of every group composes; bad values fail at start-up naming field and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from recipe.config import ConfigError, TrainConfig
from recipe.launch.overrides import quote_numeric_group_choices
from tests.helpers.config import CONF_DIR, typed_config

GROUPS = ["model", "data", "cp", "mtp", "vision", "optim", "trainer", "logger", "convention"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=lambda v: str(v)
)
def test_every_option_of_every_group_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "data" and option == "files":
        overrides.append("data.path=json")  # files needs a path; everything else is default
    if (group, option) in (("data", "shapes"), ("vision", "on")):
        overrides = ["data=shapes", "vision=on"]  # images and the model that reads them
    cfg = typed_config(overrides, tiny=False)
    assert isinstance(cfg, TrainConfig)
    if group == "model":
        assert cfg.model.name == option


def test_each_group_has_at_least_one_option():
    for group in GROUPS:
        assert _options(group), f"conf/{group}/ has no options"


def test_default_is_the_documented_one():
    cfg = typed_config(tiny=False)
    assert cfg.data.source == "markov"
    assert (cfg.cp.size, cfg.mtp.enabled, cfg.vision.enabled) == (1, False, False)
    assert cfg.logger.wandb.mode == "offline"


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("model.hidden_size=130", ["model.hidden_size=130", "num_attention_heads"]),
        ("model.num_query_groups=3", ["model.num_query_groups=3", "divide"]),
        ("model.num_layers=0", ["model.num_layers", "> 0"]),
        ("model.position_embedding_type=alibi", ["alibi", "rope", "learned_absolute"]),
        ("model.attention_backend=flash", ["model.attention_backend", "torch", "te"]),
        ("data.source=web", ["data.source", "markov", "pydoc", "files"]),
        ("data.markov.order=1", ["data.markov.order", ">= 2"]),
        (
            "batching.max_tokens_per_rank=100",
            ["batching.max_tokens_per_rank=100", "data.max_seq_len"],
        ),
        ("batching.tokens_per_step=10", ["batching.tokens_per_step=10", "max_seq_len"]),
        ("batching.tokens_per_step=-5", ["batching.tokens_per_step", "> 0"]),
        ("optim.lr=0", ["optim.lr"]),
        ("optim.min_lr=1.0", ["optim.min_lr"]),
        ("trainer.max_steps=0", ["trainer.max_steps"]),
        ("logger.wandb.mode=cloud", ["logger.wandb.mode", "offline"]),
        ("cp.preprocess=magic", ["cp.preprocess", "index", "verl_legacy"]),
        ("parallel.dp=0", ["parallel.dp"]),
        ("trainer.precision=fp16", ["trainer.precision", "bf16"]),
        ("cp.comm_type=ring", ["cp.comm_type", "p2p", "all_gather"]),
    ],
)
def test_bad_values_fail_with_a_message_naming_field_and_fix(override, fragments):
    with pytest.raises(ConfigError) as info:
        typed_config([override], tiny=True)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_data_files_without_a_path_is_rejected():
    with pytest.raises(ConfigError, match="data.path"):
        typed_config(["data=files"], tiny=False)


@pytest.mark.parametrize("override", ["model.no_such_field=1", "cp=3", "model=huge"])
def test_unknown_keys_and_options_are_rejected(override):
    with pytest.raises((ConfigCompositionException, MissingConfigException)):
        typed_config([override])


def test_wrong_type_is_rejected():
    with pytest.raises(Exception, match="hidden_size"):
        typed_config(["model.hidden_size=wide"])


def test_numeric_group_choices_are_quoted_for_hydra():
    assert quote_numeric_group_choices(["cp=2", "mtp=off", "model.hidden_size=64"]) == [
        "cp='2'",
        "mtp=off",
        "model.hidden_size=64",
    ]
    assert quote_numeric_group_choices(["cp=1,2,4"]) == ["cp='1','2','4'"]
    assert quote_numeric_group_choices(["cp.size=2"]) == ["cp.size=2"]


def test_alignment_is_2_cp_tp_under_cp_and_tp_otherwise():
    cfg = typed_config()
    assert cfg.alignment == 1
    cfg.cp.size = 2
    assert cfg.alignment == 4


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes_and_sweeps_something(experiment):
    from hydra import compose, initialize_config_dir

    from recipe.config import register_configs
    from recipe.launch.compose import to_typed

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params and "cp" in params, "every experiment compares cp settings"
    for choice in str(params["cp"]).split(","):
        assert choice.strip("'") in _options("cp")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        job_cfg = compose("train", overrides=[f"experiment={experiment}"])
    assert isinstance(to_typed(job_cfg), TrainConfig)


# The keys that name an option may repeat the default (model=tiny is the default model).
OPTION_IDENTITY_KEYS = {"model.name", "data.source"}


def _flat(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in GROUPS for o in _options(g)] + [("preset", o) for o in _options("preset")],
    ids=lambda v: str(v),
)
def test_group_files_hold_only_what_differs_from_the_dataclass_defaults(group, option):
    """The dataclasses are the one home of defaults: a YAML value equal to the default is a
    second copy that would silently win over a changed default."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / group / f"{option}.yaml")) or {}
    raw.pop("defaults", None)
    if group != "preset":  # a preset is global; a group file sits under its group's key
        raw = {group: raw}
    defaults = _flat(asdict(TrainConfig()))
    repeated = [
        key
        for key, value in _flat(raw).items()
        if key not in OPTION_IDENTITY_KEYS and key in defaults and defaults[key] == value
    ]
    assert not repeated, f"conf/{group}/{option}.yaml repeats defaults: {repeated}"


def test_a2a_needs_heads_and_groups_divisible_by_cp():
    with pytest.raises(ConfigError, match="cp.comm_type=a2a splits heads"):
        typed_config(["cp=4", "cp.comm_type=a2a", "model.num_query_groups=2"])
    assert typed_config(["cp=2", "cp.comm_type=a2a"]).cp.comm_type == "a2a"
