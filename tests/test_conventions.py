"""The conventions: each composes into the settings it names, and the conventions table says
which train the cp=1 model, with the choice that acts at each failing layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.compare.conventions import (
    BEGIN,
    END,
    acting_choices,
    sweep_tables,
    table_rows,
    write_docs,
)
from recipe.compare.diff import compare_all
from recipe.compare.runs import Run
from recipe.config import ConfigError
from tests.helpers.config import CONF_DIR, typed_config

CONVENTIONS = sorted(p.stem for p in (Path(CONF_DIR) / "convention").glob("*.yaml"))


def test_the_four_conventions_exist_and_the_recipe_is_the_default():
    assert set(CONVENTIONS) == {"recipe", "megatron_lm", "bridge@0.6.2", "verl@0.9.1"}
    cfg = typed_config()
    assert (cfg.convention.name, cfg.convention.cu_seqlens_q, cfg.convention.mtp_loss_mask) == (
        "recipe",
        "padded",
        "passed",
    )


@pytest.mark.parametrize("name", CONVENTIONS)
def test_each_convention_names_itself_and_cites_every_choice_it_makes(name):
    cfg = typed_config([f"convention={name}"])
    assert cfg.convention.name == name
    if name == "recipe":
        return
    cited = {key for s in cfg.convention.sources for key in s.keys}
    recipe = typed_config()
    flat_now, flat_recipe = _flat(cfg), _flat(recipe)
    changed = {k for k in flat_now if flat_now[k] != flat_recipe.get(k)}
    changed -= {"convention.name", "convention.sources"}
    # every setting a convention changes is explained by a cited upstream line
    assert changed <= cited, f"{name} changes {sorted(changed - cited)} without a source"
    assert all(s.where and s.quote for s in cfg.convention.sources)


def _flat(cfg) -> dict:
    from dataclasses import asdict

    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = json.dumps(node, default=str)

    walk(asdict(cfg), "")
    return out


def test_the_conventions_choices():
    bridge = typed_config(["convention=bridge@0.6.2"])
    assert (bridge.convention.cu_seqlens_q, bridge.convention.mtp_loss_mask) == ("real", "all_ones")
    assert bridge.trainer.megatron.calculate_per_token_loss
    megatron_lm = typed_config(["convention=megatron_lm"])
    assert not megatron_lm.trainer.megatron.calculate_per_token_loss
    assert megatron_lm.model.position_embedding_type == "rope"  # MTP refuses learned positions
    verl = typed_config(["convention=verl@0.9.1"])
    assert verl.cp.preprocess == "verl@0.9.1" and verl.model.pass_position_ids == "mtp_only"


def test_a_bad_choice_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="padded"):
        typed_config(["convention.cu_seqlens_q=unpadded"])


# --- the table -------------------------------------------------------------------------------


def _run(tmp_path: Path, name: str, convention: str, cp: int, mtp: bool, losses, **extra) -> Run:
    config = {
        "convention.name": convention,
        "convention.cu_seqlens_q": "real" if convention == "bridge" else "padded",
        "convention.mtp_loss_mask": "all_ones" if convention == "bridge" else "passed",
        "convention.sources": json.dumps(
            [
                {
                    "choice": "real offsets",
                    "keys": ["convention.cu_seqlens_q"],
                    "where": "megatron-bridge==0.6.2 gpt_sft.py:202-205",
                    "quote": "q",
                }
            ]
            if convention == "bridge"
            else []
        ),
        "cp.size": cp,
        "mtp.enabled": mtp,
        "mtp.scaling": "exact",
        "trainer.megatron.calculate_per_token_loss": True,
        **extra,
    }
    metrics = [{"step": i + 1, "lm_loss": v, "grad_norm": 1.0} for i, v in enumerate(losses)]
    return Run(tmp_path / name, metrics, config)


def _sweep(tmp_path):
    exact, drifted = [3.0, 2.5, 2.0], [3.0, 2.6, 2.1]
    return [
        _run(tmp_path, "0", "recipe", 1, True, exact),
        _run(tmp_path, "1", "recipe", 2, True, exact),
        _run(tmp_path, "2", "bridge", 1, True, exact),
        _run(tmp_path, "3", "bridge", 2, True, drifted),
    ]


def test_a_failing_row_cites_the_choice_that_acts_at_its_layout(tmp_path):
    rows = table_rows(compare_all(_sweep(tmp_path), 1e-5))
    assert [(r.convention, r.layout, r.verdict) for r in rows] == [
        ("recipe", "cp=2 mtp=on", "PASS"),
        ("bridge", "cp=2 mtp=on", "**FAIL**"),
    ]
    bridge = rows[1]
    assert "convention.cu_seqlens_q" in bridge.why and "gpt_sft.py:202-205" in bridge.why
    assert "lm_loss 4.8e-02 (step 3)" in bridge.drift  # 0.1 / 2.1
    # the PASS row's control is the failing row of the same layout
    assert rows[0].control == "`bridge`"


def test_a_passing_row_without_a_failing_neighbour_says_so(tmp_path):
    runs = _sweep(tmp_path)[:2]
    (row,) = table_rows(compare_all(runs, 1e-5))
    assert row.verdict == "PASS" and row.control == "none at this layout"


def test_choices_act_only_where_megatron_core_makes_them_matter(tmp_path):
    def acting(**config):
        run = _run(tmp_path, "x", "bridge", config.pop("cp"), config.pop("mtp"), [1.0], **config)
        return [a.key for a, _ in acting_choices(run)]

    # real offsets change the MTP roll only under CP with MTP on
    assert acting(cp=1, mtp=True) == []
    assert acting(cp=2, mtp=False) == []
    assert acting(cp=2, mtp=True) == ["convention.cu_seqlens_q", "convention.mtp_loss_mask"]
    # the loss normalisation acts at cp > 1 with or without MTP
    assert "trainer.megatron.calculate_per_token_loss" in acting(
        cp=2, mtp=False, **{"trainer.megatron.calculate_per_token_loss": False}
    )
    # the embedding groups only with learned positions, MTP and pp > 1
    sync = {"trainer.megatron.sync_mtp_position_embeddings": False, "parallel.pp": 2}
    assert "trainer.megatron.sync_mtp_position_embeddings" in acting(
        cp=1, mtp=True, **sync, **{"model.position_embedding_type": "learned_absolute"}
    )
    assert "trainer.megatron.sync_mtp_position_embeddings" not in acting(
        cp=1, mtp=True, **sync, **{"model.position_embedding_type": "rope"}
    )


def test_the_docs_table_is_replaced_between_its_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    table = sweep_tables([("main", _sweep(tmp_path), [])])
    write_docs(table, page)
    text = page.read_text()
    assert "old table" not in text and "| bridge | cp=2 mtp=on | **FAIL**" in text
    assert text.startswith("intro\n") and text.endswith("outro\n")
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="BEGIN"):
        write_docs(table, page)


def _job(sweep: Path, num: int, convention: str, cp: int, losses, overrides=(), error=None):
    """A job directory as a sweep leaves it: its config, overrides, metrics and job record."""
    import yaml

    run = sweep / str(num)
    (run / ".hydra").mkdir(parents=True)
    config = {
        "convention": {"name": convention, "cu_seqlens_q": "padded", "sources": []},
        "cp": {"size": cp, "preprocess": "index"},
        "parallel": {"dp": 1, "tp": 1, "pp": 1},
        "mtp": {"enabled": True, "scaling": "upstream"},
        "output_dir": str(run),
    }
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    job_overrides = [f"convention={convention}", f"cp={cp}", "mtp=on", *overrides]
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(job_overrides))
    rows = [
        {"step": i + 1, "lm_loss": v, "mtp_loss": v, "grad_norm": 1.0} for i, v in enumerate(losses)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (sweep / ".jobs").mkdir(exist_ok=True)
    record = {"num": num, "output_dir": str(run), "metrics": True, "error": error}
    (sweep / ".jobs" / f"{num}.json").write_text(json.dumps(record))


def test_the_command_writes_one_table_per_sweep_with_raises_and_ablation_labels(tmp_path, capsys):
    from recipe.compare.conventions import main

    exact, drifted = [3.0, 2.5, 2.0], [3.0, 2.6, 2.1]
    sweep = tmp_path / "main"
    _job(sweep, 0, "verl", 1, exact)
    _job(sweep, 1, "verl", 2, drifted)
    raised = "rank 1 failed (exit code 1) on vm: IndexError: list index out of range at x.py:3"
    _job(sweep, 2, "verl", 4, exact[:1], error=raised)  # logged step 1, then raised
    ablation = tmp_path / "ablation"
    _job(ablation, 0, "verl", 1, exact, ["mtp.scaling=exact"])
    _job(ablation, 1, "verl", 2, exact, ["mtp.scaling=exact"])
    main([str(sweep), str(ablation)])
    out = capsys.readouterr().out
    assert out.index("#### main") < out.index("#### ablation") < out.index("#### The choices")
    main_table = out[out.index("#### main") : out.index("#### ablation")]
    assert "| verl | cp=2 mtp=on | **FAIL** |" in main_table
    # the job that raised is one RAISES row with megatron's line, not a FAIL row too
    assert f"| verl | cp=4 mtp=on | **RAISES** | `{raised}` |" in main_table
    assert "cp=4 mtp=on | **FAIL**" not in main_table
    # the ablation's own override labels its rows; its cp=1 baseline is no row
    assert "| verl mtp.scaling=exact | cp=2 mtp=on | PASS |" in out
    assert "cp=1 mtp=on" not in out


@pytest.mark.parametrize("mask", ["passed", "all_ones"])
def test_every_mtp_target_is_counted_once_under_each_loss_mask(mask):
    """The plan's MTP masks are what megatron rolls (the loss mask, or all ones when the model
    is given none), and the ranks' counts add up to the plan's: the trainer's per-step check
    that every predicted token was counted exactly once holds under either convention."""
    import torch

    from recipe.config.layout import ParallelDims
    from recipe.training.step import plan_step

    cfg = typed_config(["mtp=on", "cp=2", f"convention.mtp_loss_mask={mask}"])
    dims = ParallelDims(cp=2)
    sequences = [list(range(1, n + 1)) for n in (5, 9, 3, 12)]
    works = [
        plan_step(sequences, cfg, dims.layout_of(rank), 0, torch.device("cpu")) for rank in range(2)
    ]
    counted = sum(float(b.mtp_mask.sum()) for w in works for b in w.micro_batches)
    assert counted == works[0].global_mtp_tokens[0]
    padded = sum(-(-n // 4) * 4 for n in (5, 9, 3, 12))
    if mask == "all_ones":  # every padded slot but the last of each sequence
        assert counted == padded - 4
    else:  # each sequence's real targets of MTP layer 1: n - 2
        assert counted == sum(n - 2 for n in (5, 9, 3, 12))


def test_a_failed_job_is_summed_up_with_the_upstream_line_that_raised():
    from recipe.compare.sweep import error_summary

    traceback = "\n".join(
        [
            "rank 1 failed (exit code 1) on vm:",
            "Traceback (most recent call last):",
            '  File "/w/recipe/training/micro_batch.py", line 103, in forward',
            '  File "/v/site-packages/megatron/core/transformer/multi_token_prediction.py", '
            "line 313, in _roll_tensor_packed_seq",
            "IndexError: list index out of range",
            "(also failed: rank 0, exit code 1: IndexError: list index out of range)",
        ]
    )
    assert error_summary(traceback) == (
        "rank 1 failed (exit code 1) on vm: IndexError: list index out of range at "
        "megatron/core/transformer/multi_token_prediction.py:313"
    )
    # the recipe's own errors already name the problem: left as they are
    said = "rank 0 failed (exit code 1) on vm: ConfigError: cp.size must divide"
    assert error_summary(said) == said
    assert error_summary("") == "unknown error"


def test_a_sweep_gets_a_conventions_table_when_it_trains_a_framework_convention(tmp_path):
    from recipe.compare.conventions import uses_conventions

    def runs(*names):
        return [Run(tmp_path / str(i), [], {"convention.name": n}) for i, n in enumerate(names)]

    assert not uses_conventions(runs("recipe", "recipe"))  # e.g. experiment=cp_parity
    assert uses_conventions(runs("recipe", "megatron_lm"))  # experiment=conventions
    assert uses_conventions(runs("bridge@0.6.2", "bridge@0.6.2"))  # one framework's ablation


def test_a_recipe_setting_turned_off_cites_the_megatron_line_behind_it(tmp_path):
    """The recipe's own convention cites nothing; with its MTP position-embedding sync off (as
    megatron is released) a failing pp=2 row names megatron-core's position-embedding group."""
    off = {
        "trainer.megatron.sync_mtp_position_embeddings": False,
        "model.position_embedding_type": "learned_absolute",
    }
    runs = [
        _run(tmp_path, "0", "recipe", 1, True, [3.0, 2.5], **off, **{"parallel.pp": 1}),
        _run(tmp_path, "1", "recipe", 1, True, [3.0, 2.6], **off, **{"parallel.pp": 2}),
    ]
    (row,) = table_rows(compare_all(runs, 1e-5))
    assert row.verdict == "**FAIL**" and row.layout == "cp=1 pp=2 mtp=on"
    assert "megatron/core/parallel_state.py:569-572" in row.why
