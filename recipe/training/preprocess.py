"""The function `cp.preprocess` names from outside the recipe, loaded once per process.

A user's `package.module:function` is imported; a release (`LIBRARY@VERSION[/FUNCTION]`) is
loaded from its wheel by `recipe.upstream`, reading megatron's real parallel state in training
and a stand-in when one process plays every rank for the check. What kind of string it is was
decided by `recipe.config.preprocess`; sharding itself (`recipe.parallel.cp.shard`) receives
the loaded functions, so the CP hot path never reaches for a loader.
"""

from __future__ import annotations

import functools

from recipe.config.preprocess import RELEASE, parse_preprocess
from recipe.parallel.cp.contract import LoadedPreprocess, load_function


@functools.cache
def load_preprocess(text: str) -> LoadedPreprocess | None:
    """The loaded functions of `cp.preprocess=text`; None for the recipe's own ways."""
    spec = parse_preprocess(text)
    if spec.built_in:
        return None
    if spec.kind == RELEASE:
        from recipe.upstream.releases import checking_preprocess, training_preprocess

        return LoadedPreprocess(
            training_preprocess(text),
            checking_preprocess(text),
            f"python -m recipe.check_upstream {spec.release}",
        )
    fn = load_function(text)
    return LoadedPreprocess(fn, fn, f"python -m recipe.check_preprocess {text}")
