"""Where documents come from: the generated Markov chain, CPython's pydoc topics, or any files.

Every text source goes through Hugging Face `datasets`, so local files (json, parquet, text, csv)
and hub datasets behave the same and fail the same way: a missing file, a missing column or an
empty split becomes a ConfigError that says which and what would be valid.
"""

from __future__ import annotations

from recipe.config import ConfigError, DataConfig
from recipe.data.markov import MarkovChain
from recipe.log import get_logger

log = get_logger(__name__)


def markov_documents(cfg: DataConfig) -> tuple[list[str], list[str], MarkovChain]:
    m = cfg.markov
    chain = MarkovChain.create(
        m.order, m.alphabet_size, m.concentration, m.mean_doc_len, m.max_doc_len, seed=cfg.seed
    )
    train = chain.sample_documents(m.num_train_docs, seed=cfg.seed + 1)
    eval_ = chain.sample_documents(m.num_eval_docs, seed=cfg.seed + 2)
    return train, eval_, chain


def _texts_from_dataset(
    dataset, text_field: str, where: str, max_malformed_fraction: float = 0.0
) -> list[str]:
    """The column's texts. Empty strings (blank lines of a text file) are skipped and counted;
    rows whose value is missing, null or not a string (a number, a list) are malformed: counted,
    named in the log, and an error when they are more than `max_malformed_fraction` of the rows."""
    if text_field not in dataset.column_names:
        raise ConfigError(
            f"{where} has no column {text_field!r}; its columns are {dataset.column_names}. "
            "Set data.text_field to one of them"
        )
    values = dataset[text_field]
    texts = [t for t in values if isinstance(t, str) and t]
    malformed: dict[str, int] = {}
    for value in values:
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            malformed[kind] = malformed.get(kind, 0) + 1
    empty = sum(1 for t in values if t == "")
    bad = sum(malformed.values())
    if bad or empty:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(malformed.items()))
        log.info(
            f"{where}: {len(texts)} of {len(values)} rows of {text_field!r} used; skipped "
            f"{empty} empty" + (f" and {bad} malformed ({kinds})" if bad else "")
        )
    if values and bad / len(values) > max_malformed_fraction:
        raise ConfigError(
            f"{where}: {bad} of {len(values)} rows of column {text_field!r} are not text "
            f"({kinds}), more than data.max_malformed_fraction={max_malformed_fraction:g}; fix "
            "the data, choose another data.text_field, or raise data.max_malformed_fraction"
        )
    if not texts:
        raise ConfigError(f"{where} has no non-empty text in column {text_field!r}")
    return texts


def pydoc_documents() -> list[str]:
    from pydoc_data.topics import topics

    import datasets

    names = sorted(topics)
    dataset = datasets.Dataset.from_dict({"topic": names, "text": [topics[n] for n in names]})
    return _texts_from_dataset(dataset, "text", "pydoc_data.topics")


BUILDER_OF_SUFFIX = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".csv": "csv",
}


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return err


def file_documents(cfg: DataConfig) -> list[str]:
    from pathlib import Path

    import datasets

    where = f"data.path={cfg.path!r}" + (
        f" data.data_files={cfg.data_files!r}" if cfg.data_files else ""
    )
    if Path(cfg.path).is_file():
        builder = BUILDER_OF_SUFFIX.get(Path(cfg.path).suffix.lower(), "json")
        raise ConfigError(
            f"data.path={cfg.path} is a file; data.path names the format and data.data_files "
            f"the files: data.path={builder} data.data_files={cfg.path}"
        )
    try:
        dataset = datasets.load_dataset(
            cfg.path, name=cfg.name, data_files=cfg.data_files, split=cfg.split
        )
    except FileNotFoundError as err:
        raise ConfigError(
            f"cannot read {where}: {err}. Check the path (relative paths are taken "
            "from the directory you started in)"
        ) from err
    except StopIteration as err:  # the json builder's way of saying "no rows"
        raise ConfigError(f"{where} is empty: no rows to read") from err
    except ValueError as err:
        raise ConfigError(f"cannot load {where} split {cfg.split!r}: {err}") from err
    except Exception as err:  # decode errors, connection errors, unknown builders
        cause = _root_cause(err)  # DatasetGenerationError hides e.g. a UnicodeDecodeError
        if type(cause).__name__ == "SchemaInferenceError":
            raise ConfigError(f"{where} is empty: no rows to read") from err
        hint = ""
        if isinstance(cause, UnicodeDecodeError):
            hint = "; the files must be UTF-8 (convert them, e.g. with iconv)"
        raise ConfigError(f"cannot load {where}: {type(cause).__name__}: {cause}{hint}") from err
    if len(dataset) == 0:
        raise ConfigError(f"{where} split {cfg.split!r} is empty")
    return _texts_from_dataset(dataset, cfg.text_field, where, cfg.max_malformed_fraction)
