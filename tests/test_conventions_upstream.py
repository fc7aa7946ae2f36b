"""The conventions (conf/convention/*.yaml) against the released wheels they cite.

Every `where` that names a wheel (DIST==VERSION path:LINES) is fetched and its quote must be on
the cited lines; a GitHub-only citation must be listed in GITHUB_ONLY with why it is not checked.
Then each choice the recipe re-creates is read back from the wheel, by running the framework's
glue on a recorded batch (Bridge's packed collate and get_packed_seq_params) or by parsing the
model call out of its source, and turned into the convention value it amounts to: the YAML must
hold that value, and every other value of the key must disagree with the wheel (so flipping a
choice in a YAML fails here). The wheels are fetched by pip into the upstream cache once:
marked `launches`.
"""

from __future__ import annotations

import ast
import math
import re
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recipe.data.packing import pack_sequences
from recipe.model.gpt import packed_seq_params
from recipe.names import CU_SEQLENS_Q, MTP_LOSS_MASKS, PASS_POSITION_IDS
from recipe.upstream.source import UpstreamUnavailable, load_module, source_file
from tests.helpers.config import CONF_DIR

pytestmark = pytest.mark.launches

CONVENTION_DIR = Path(CONF_DIR) / "convention"
WHEEL_WHERE = re.compile(
    r"(?P<dist>[\w.-]+)==(?P<version>\S+) (?P<path>\S+):(?P<first>\d+)(?:-(?P<last>\d+))?"
)
GITHUB_WHERE = re.compile(r"[\w.-]+/[\w.-]+@\S+ \S+:\d+(?:-\d+)?")

GITHUB_ONLY = {
    ("megatron_lm", "NVIDIA/Megatron-LM@core_r0.19.0 pretrain_gpt.py:348-355"): (
        "pretrain_gpt.py ships in no wheel (the megatron-core wheel has megatron/training/ but "
        "not the entry script); checking it needs the GitHub tag"
    ),
}
"""GitHub citations (OWNER/REPO@REF path:LINES) this file cannot check offline, with why."""

BRIDGE = ("megatron-bridge", "0.6.2")
VERL = ("verl", "0.9.1")
# the wheel's file: fetched where another release is installed (legacy: 0.16.1), else the
# installed copy when its RECORD hash says it is the wheel's
MCORE = ("megatron-core", "0.19.2")


# --- the conventions and their citations ------------------------------------------------------


def _load_convention(path: Path) -> dict:
    """The YAML as Hydra would read it: OmegaConf's loader, which refuses duplicate keys."""
    return OmegaConf.to_container(OmegaConf.load(path))


def _citation_params() -> list:
    params = []
    for path in sorted(CONVENTION_DIR.glob("*.yaml")):
        try:
            sources = _load_convention(path)["convention"].get("sources") or []
        except Exception as err:  # an unloadable YAML fails as one case, not the collection
            params.append(pytest.param(path.stem, None, err, id=f"{path.stem}-unloadable"))
            continue
        for index, source in enumerate(sources):
            params.append(pytest.param(path.stem, source, None, id=f"{path.stem}-{index}"))
    return params


CITATIONS = _citation_params()


def citation_problem(where: str, quote: str) -> str | None:
    """What is wrong with a wheel citation (None: the quote is on the cited lines)."""
    match = WHEEL_WHERE.fullmatch(where)
    if match is None:
        return f"{where!r} is not DIST==VERSION path:LINE[-LINE]"
    first = int(match["first"])
    last = int(match["last"] or first)
    if last < first:
        return f"{where!r}: the range runs backwards"
    try:
        path, _ = source_file(match["dist"], match["version"], match["path"])
    except UpstreamUnavailable as err:
        return f"{where!r}: {err}"
    lines = path.read_text().splitlines()
    if last > len(lines):
        return f"{where!r}: the file has {len(lines)} lines"
    cited = "\n".join(lines[first - 1 : last])
    if quote in cited:
        return None
    elsewhere = [n for n, line in enumerate(lines, 1) if quote in line]
    return f"{where!r} does not hold {quote!r}; a line that does: {elsewhere or 'none'}"


@pytest.mark.parametrize(("name", "source", "load_error"), CITATIONS)
def test_every_cited_line_holds_its_quote(name, source, load_error):
    assert load_error is None, f"conf/convention/{name}.yaml does not load: {load_error}"
    where, quote = source.get("where", ""), source.get("quote", "")
    if not where:
        assert not quote, f"{name}: {source['choice']!r} quotes without a `where`"
        return
    if GITHUB_WHERE.fullmatch(where) and not WHEEL_WHERE.fullmatch(where):
        assert (name, where) in GITHUB_ONLY, (
            f"{name} cites {where!r}, which no wheel holds: check it and list it in GITHUB_ONLY "
            "with the reason it cannot be checked here"
        )
        return
    assert citation_problem(where, quote) is None, citation_problem(where, quote)


# What each megatron-core line the conventions table names (recipe.compare.conventions.ACTING)
# must say: the table shows it where a convention cites nothing for the key.
ACTING_QUOTES = {
    "convention.cu_seqlens_q": "cu_seqlens = packed_seq_params.cu_seqlens_q",
    "convention.mtp_loss_mask": "loss_mask = torch.ones_like(mtp_labels)",
    "mtp.scaling": "original_num_tokens / num_tokens_safe",
    "trainer.megatron.calculate_per_token_loss": "output_tensor /= torch.clamp(num_tokens, min=1)",
    "trainer.megatron.sync_mtp_position_embeddings": "return [pp_ranks[0]]",
}


def test_every_megatron_line_the_table_names_holds_what_it_says():
    from recipe.compare.conventions import ACTING

    named = {a.key: a.megatron for a in ACTING if a.megatron}
    assert set(named) == set(ACTING_QUOTES), "a new ACTING line needs its quote here"
    for key, where in named.items():
        assert citation_problem(where, ACTING_QUOTES[key]) is None, key


def test_github_only_lists_exactly_the_github_citations():
    cited = set()
    for name, source, load_error in (p.values for p in CITATIONS):
        where = (source or {}).get("where", "")
        if (
            load_error is None
            and GITHUB_WHERE.fullmatch(where)
            and not WHEEL_WHERE.fullmatch(where)
        ):
            cited.add((name, where))
    assert cited == set(GITHUB_ONLY), "GITHUB_ONLY must name every GitHub citation, and no more"


def test_the_citation_checker_reports_a_shifted_range_and_a_missing_file():
    where = "megatron-bridge==0.6.2 megatron/bridge/data/packing/gpt_sft.py:202-205"
    quote = "cu_seqlens contains logical offsets, while cu_seqlens_padded"
    assert citation_problem(where, quote) is None
    shifted = "megatron-bridge==0.6.2 megatron/bridge/data/packing/gpt_sft.py:242-245"
    assert "does not hold" in citation_problem(shifted, quote)
    assert "a line that does: [202]" in citation_problem(shifted, quote)
    missing = "megatron-bridge==0.6.2 megatron/bridge/data/packing/no_such_file.py:1"
    assert "no megatron/bridge/data/packing/no_such_file.py" in citation_problem(missing, quote)
    assert "is not DIST==VERSION" in citation_problem("gpt_sft.py:202", quote)


# --- what each wheel's glue amounts to, as a convention value ---------------------------------

EOS = 2
LENGTHS = (5, 9, 3)
ALIGNMENT = 4


def _recorded_sequences() -> list[list[int]]:
    """Sequences of LENGTHS real tokens (none of them EOS), each needing padding at ALIGNMENT."""
    start, sequences = 10, []
    for length in LENGTHS:
        sequences.append(list(range(start, start + length)))
        start += length
    return sequences


def _class_methods(path: Path, class_name: str, names: tuple[str, ...]) -> dict:
    """Methods of `class_name` in the file at `path`, executed from their own source."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    namespace = {"math": math, "np": np, "torch": torch}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(textwrap.dedent(ast.get_source_segment(path.read_text(), node)), namespace)
    missing = [n for n in names if n not in namespace]
    assert not missing, f"{path.name}'s {class_name} has no {missing}"
    return {n: namespace[n] for n in names}


def _bridge_collated_batch(sequences: list[list[int]]) -> dict:
    """Bridge's GPTSFTPackedDataset.collate_fn (packing with pad_seq_to_mult = ALIGNMENT) on one
    pack of `sequences`, each stored as packing/offline.py stores it: its tokens, EOS, and EOS
    padding up to ceil(len, ALIGNMENT) + 1 (the collate drops each sequence's last slot)."""
    base_path, _ = source_file(*BRIDGE, "megatron/bridge/data/datasets/gpt_sft.py")
    base = type(
        "GPTSFTDataset",
        (),
        _class_methods(base_path, "GPTSFTDataset", ("_ceil_to_nearest", "_collate_item")),
    )
    path, _ = source_file(*BRIDGE, "megatron/bridge/data/packing/gpt_sft.py")
    stubs = {
        "megatron.core.msc_utils": {},
        "megatron.bridge.data.datasets.gpt_sft": {"GPTSFTDataset": base},
        "megatron.bridge.training.tokenizers.tokenizer": {},
        "megatron.bridge.utils.safe_pickle": {},
    }
    module = load_module(path, "tests_conventions_bridge_packing_gpt_sft", stubs)
    dataset = object.__new__(module.GPTSFTPackedDataset)
    dataset.__dict__.update(
        tokenizer=types.SimpleNamespace(eos_id=EOS),
        _pad_seq_to_mult=ALIGNMENT,
        pad_seq_length_to_mult=ALIGNMENT,
        pad_to_max_length=False,
        max_seq_length=1024,
        ceil_to_power_2=False,
        answer_only_loss=False,
        pad_cu_seqlens=False,
        return_cu_seqlen=True,
        pack_metadata=None,
    )
    input_ids, boundaries = [], [0]
    for tokens in sequences:
        padded = -(-len(tokens) // ALIGNMENT) * ALIGNMENT
        input_ids += tokens + [EOS] * (padded - len(tokens) + 1)
        boundaries.append(len(input_ids))
    item = {"input_ids": input_ids, "seq_boundaries": boundaries, "loss_mask": [1] * len(input_ids)}
    return dataset.collate_fn([item])


def _bridge_get_packed_seq_params():
    path, _ = source_file(*BRIDGE, "megatron/bridge/training/utils/packed_seq_utils.py")
    module = load_module(path, "tests_conventions_bridge_packed_seq_utils", {})
    return module.get_packed_seq_params


PARAMS_FIELDS = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def _fields(params) -> dict:
    def plain(value):
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), value.tolist())
        return value

    return {name: plain(getattr(params, name)) for name in PARAMS_FIELDS}


def bridge_cu_seqlens_q() -> str:
    """The recipe's cu_seqlens_q setting whose PackedSeqParams equal Bridge's on the same batch."""
    sequences = _recorded_sequences()
    batch = pack_sequences(sequences, ALIGNMENT, pad_id=EOS)
    collated = _bridge_collated_batch(sequences)
    # the same recorded input reached both: the stream and its positions agree slot for slot
    assert collated["tokens"][0].tolist() == batch.input_ids.tolist()
    assert collated["position_ids"][0].tolist() == batch.position_ids.tolist()
    assert (
        collated["cu_seqlens_q"][0].tolist()
        == batch.cu_seqlens.tolist()
        != (batch.cu_seqlens_padded.tolist())
    ), "the recorded batch must need padding, or the two offsets cannot be told apart"
    bridge = _fields(_bridge_get_packed_seq_params()(collated))
    matching = [v for v in CU_SEQLENS_Q if _fields(packed_seq_params(batch, v)) == bridge]
    assert len(matching) == 1, f"Bridge's PackedSeqParams {bridge} match {matching}"
    return matching[0]


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"expected one function {name}, found {len(found)}"
    return found[0]


def _source(release: tuple[str, str], relative: str, edit=None) -> str:
    """The wheel file's text; `edit` (text -> text) changes it for a negative control."""
    path, _ = source_file(*release, relative)
    text = path.read_text()
    return text if edit is None else edit(text)


def _parse(release: tuple[str, str], relative: str, edit=None) -> ast.Module:
    return ast.parse(_source(release, relative, edit))


def _parents(tree: ast.AST) -> dict:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _bridge_forward_args(edit=None) -> dict[str, ast.expr]:
    """Key -> value expression of the kwargs gpt_step.py hands `model(**forward_args)`: the dict
    literal assigned to forward_args plus every `forward_args[KEY] = ...` in that function."""
    tree = _parse(BRIDGE, "megatron/bridge/training/gpt_step.py", edit)

    def calls_model(function):
        return any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "model"
            and [ast.unparse(k.value) for k in n.keywords if k.arg is None] == ["forward_args"]
            for n in ast.walk(function)
        )

    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and calls_model(n)]
    assert len(functions) == 1, [f.name for f in functions]
    args: dict[str, ast.expr] = {}
    for node in ast.walk(functions[0]):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "forward_args":
            assert isinstance(node.value, ast.Dict), ast.unparse(node)
            args.update(
                {ast.literal_eval(k): v for k, v in zip(node.value.keys, node.value.values)}
            )
        elif isinstance(target, ast.Subscript) and ast.unparse(target.value) == "forward_args":
            args[ast.literal_eval(target.slice)] = node.value
    assert {"input_ids", "labels", "packed_seq_params"} <= set(args), sorted(args)
    return args


def bridge_mtp_loss_mask(edit=None) -> str:
    return "passed" if "loss_mask" in _bridge_forward_args(edit) else "all_ones"


def bridge_pass_position_ids(edit=None) -> str:
    value = _bridge_forward_args(edit).get("position_ids")
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return "never"
    assert isinstance(value, ast.Name), f"position_ids is conditional: {ast.unparse(value)}"
    return "always"


def _verl_model_engine_forward(edit=None) -> tuple[ast.FunctionDef, ast.Call]:
    """verl's gptmodel_forward_model_engine and its THD model call (the one given
    packed_seq_params)."""
    tree = _parse(VERL, "verl/models/mcore/model_forward.py", edit)
    function = _function(tree, "gptmodel_forward_model_engine")
    calls = [
        n
        for n in ast.walk(function)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == "model"
        and any(k.arg == "packed_seq_params" for k in n.keywords)
    ]
    assert len(calls) == 1, [ast.unparse(c) for c in calls]
    return function, calls[0]


def verl_pass_position_ids(edit=None) -> str:
    _, call = _verl_model_engine_forward(edit)
    value = next(k.value for k in call.keywords if k.arg == "position_ids")
    if isinstance(value, ast.Constant) and value.value is None:
        return "never"
    if isinstance(value, ast.Name):
        return "always"
    assert isinstance(value, ast.IfExp), ast.unparse(value)
    assert ast.unparse(value.test) == "mtp_enable_train", ast.unparse(value)
    assert isinstance(value.orelse, ast.Constant) and value.orelse.value is None
    return "mtp_only"


def verl_mtp_loss_mask(edit=None) -> str:
    """passed: model_kwargs["loss_mask"] is set, and only under `if mtp_enable_train ...`, in the
    THD branch that makes the model call."""
    function, call = _verl_model_engine_forward(edit)
    parents = _parents(function)
    thd_branch = call
    while not (isinstance(thd_branch, ast.If) and "data_format" in ast.unparse(thd_branch.test)):
        thd_branch = parents[thd_branch]
    sets = [
        n
        for n in ast.walk(thd_branch)
        if isinstance(n, ast.Assign)
        and any(ast.unparse(t) == "model_kwargs['loss_mask']" for t in n.targets)
    ]
    for node in sets:
        guards = []
        while node is not thd_branch:
            node = parents[node]
            if isinstance(node, ast.If):
                guards.append(ast.unparse(node.test))
        assert any("mtp_enable_train" in g for g in guards), f"loss_mask set under {guards}"
    return "passed" if sets else "all_ones"


def verl_cu_seqlens_q(edit=None) -> str:
    tree = _parse(VERL, "verl/models/mcore/util.py", edit)
    function = _function(tree, "preprocess_thd_engine")
    calls = [
        n
        for n in ast.walk(function)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "PackedSeqParams"
    ]
    assert len(calls) == 1, [ast.unparse(c) for c in calls]
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords if k.arg}
    assert keywords["cu_seqlens_q"] == keywords["cu_seqlens_kv"], keywords
    return "padded" if keywords["cu_seqlens_q"] == keywords["cu_seqlens_q_padded"] else "real"


def mcore_calculate_per_token_loss(edit=None) -> bool:
    """TransformerConfig's default, which --calculate-per-token-loss is generated from."""
    tree = _parse(MCORE, "megatron/core/transformer/transformer_config.py", edit)
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransformerConfig"
    )
    field = next(
        n
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "calculate_per_token_loss"
    )
    return ast.literal_eval(field.value)


def mcore_syncs_mtp_position_embeddings(edit=None) -> bool:
    """Whether megatron-core's default position-embedding group holds the MTP stage (the last
    pipeline stage when no layout places it): default_position_embedding_ranks, run from the
    wheel's source."""
    text = _source(MCORE, "megatron/core/parallel_state.py", edit)
    function = _function(ast.parse(text), "default_position_embedding_ranks")
    namespace: dict = {}
    exec(ast.get_source_segment(text, function), namespace)
    pp_ranks = [0, 4, 8, 12]
    ranks = namespace["default_position_embedding_ranks"](pp_ranks)
    assert pp_ranks[0] in ranks, ranks
    return pp_ranks[-1] in ranks


UPSTREAM = [
    ("bridge@0.6.2", "convention.cu_seqlens_q", bridge_cu_seqlens_q, CU_SEQLENS_Q),
    ("bridge@0.6.2", "convention.mtp_loss_mask", bridge_mtp_loss_mask, MTP_LOSS_MASKS),
    ("bridge@0.6.2", "model.pass_position_ids", bridge_pass_position_ids, PASS_POSITION_IDS),
    ("verl@0.9.1", "model.pass_position_ids", verl_pass_position_ids, PASS_POSITION_IDS),
    ("verl@0.9.1", "convention.mtp_loss_mask", verl_mtp_loss_mask, MTP_LOSS_MASKS),
    ("verl@0.9.1", "convention.cu_seqlens_q", verl_cu_seqlens_q, CU_SEQLENS_Q),
    (
        "megatron_lm",
        "trainer.megatron.calculate_per_token_loss",
        mcore_calculate_per_token_loss,
        (True, False),
    ),
    *(
        (
            name,
            "trainer.megatron.sync_mtp_position_embeddings",
            mcore_syncs_mtp_position_embeddings,
            (True, False),
        )
        for name in ("bridge@0.6.2", "megatron_lm", "verl@0.9.1")
    ),
]
"""(convention, key, what the wheel amounts to for that key, the key's possible values)."""

_upstream_cache: dict = {}


def _upstream(derive):
    if derive not in _upstream_cache:
        _upstream_cache[derive] = derive()
    return _upstream_cache[derive]


def _yaml_value(name: str, key: str):
    value = OmegaConf.select(OmegaConf.load(CONVENTION_DIR / f"{name}.yaml"), key)
    assert value is not None, f"conf/convention/{name}.yaml does not set {key}"
    return value


def disagreement(name: str, key: str, derive, value) -> str | None:
    """Why `value` for `key` in convention `name` is not what the wheel does (None: it is)."""
    upstream = _upstream(derive)
    if value == upstream:
        return None
    return f"conf/convention/{name}.yaml: {key}={value!r}, but {derive.__name__} gives {upstream!r}"


def _cases(flipped: bool) -> list:
    cases = []
    for name, key, derive, values in UPSTREAM:
        case_id = f"{name}-{key}"
        if not flipped:
            cases.append(pytest.param(name, key, derive, id=case_id))
            continue
        try:
            own = _yaml_value(name, key)
        except Exception:  # an unloadable YAML fails in the test above; flip every value here
            own = None
        for other in values:
            if other != own:
                cases.append(pytest.param(name, key, derive, other, id=f"{case_id}={other}"))
    return cases


@pytest.mark.parametrize(("name", "key", "derive"), _cases(flipped=False))
def test_the_convention_holds_what_the_wheel_does(name, key, derive):
    problem = disagreement(name, key, derive, _yaml_value(name, key))
    assert problem is None, problem


@pytest.mark.parametrize(("name", "key", "derive", "flipped"), _cases(flipped=True))
def test_a_flipped_choice_disagrees_with_the_wheel(name, key, derive, flipped):
    """The negative control of the test above: the YAML holding any other value of the key."""
    assert disagreement(name, key, derive, flipped) is not None


def _replace(old: str, new: str):
    """An edit of a wheel file for a negative control: `old` must be in it."""

    def edit(text: str) -> str:
        assert old in text, f"the negative control's {old!r} is no longer in the wheel's file"
        return text.replace(old, new)

    return edit


@pytest.mark.parametrize(
    ("derive", "edit", "changed"),
    [
        (
            bridge_mtp_loss_mask,
            _replace('"labels": labels,', '"labels": labels, "loss_mask": loss_mask,'),
            "passed",
        ),
        (
            bridge_pass_position_ids,
            _replace('"position_ids": position_ids,', '"position_ids": None,'),
            "never",
        ),
        (
            verl_pass_position_ids,
            _replace(
                "position_ids=position_ids_rmpad if mtp_enable_train else None",
                "position_ids=position_ids_rmpad",
            ),
            "always",
        ),
        (
            verl_mtp_loss_mask,
            _replace('model_kwargs["loss_mask"] = args["loss_mask"].contiguous()', "pass"),
            "all_ones",
        ),
        (
            verl_cu_seqlens_q,
            lambda text: _replace("cu_seqlens_kv=cu_seqlens_padded,", "cu_seqlens_kv=real,")(
                _replace("cu_seqlens_q=cu_seqlens_padded,", "cu_seqlens_q=real,")(text)
            ),
            "real",
        ),
        (
            mcore_calculate_per_token_loss,
            _replace(
                "calculate_per_token_loss: bool = False", "calculate_per_token_loss: bool = True"
            ),
            True,
        ),
        (
            mcore_syncs_mtp_position_embeddings,
            _replace("    return [pp_ranks[0]]\n", "    return [pp_ranks[0], pp_ranks[-1]]\n"),
            True,
        ),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)).replace("<lambda>", "edit"),
)
def test_each_reading_of_the_wheel_sees_a_changed_release(derive, edit, changed):
    """Negative control of the readings themselves: the wheel's file edited to make the other
    choice reads as that choice (and the unedited file as the YAML's)."""
    assert derive() != changed
    assert derive(edit) == changed


def test_the_recipes_padded_offsets_are_not_bridges():
    """Control for bridge_cu_seqlens_q: the recipe's default PackedSeqParams differ from the
    ones Bridge builds from its collated batch (in cu_seqlens_q and cu_seqlens_kv)."""
    sequences = _recorded_sequences()
    batch = pack_sequences(sequences, ALIGNMENT, pad_id=EOS)
    bridge = _fields(_bridge_get_packed_seq_params()(_bridge_collated_batch(sequences)))
    padded = _fields(packed_seq_params(batch, "padded"))
    real = _fields(packed_seq_params(batch, "real"))
    assert real == bridge
    assert {k for k in PARAMS_FIELDS if padded[k] != bridge[k]} == {"cu_seqlens_q", "cu_seqlens_kv"}
