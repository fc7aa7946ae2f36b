"""Which dotted keys (`trainer.max_steps`) the schema defines, so that a typo on the command line
is named, with the closest key, before Hydra answers it with advice to add the key with `+`."""

from __future__ import annotations

import dataclasses
import difflib

from recipe.config.schema import TrainConfig


def unknown_key(key: str, schema: type = TrainConfig, root: str = "") -> str | None:
    """`unknown config key trainer.max_step; did you mean trainer.max_steps?` when the dataclasses
    of `schema` have no such key, else None. Below a field that is not a section (a list, a dict,
    `Any`) every key passes: the schema cannot tell. `root` is where `schema` sits (`hydra.` for
    Hydra's own HydraConf), put before every name in the message."""
    section, prefix = schema, root
    for name in key.split("."):
        fields = {f.name: f for f in dataclasses.fields(section)}
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            guess = f"{prefix}{close[0]}" if close else _deeper(name, section, prefix)
            hint = f"; did you mean {guess}?" if guess else ""
            return f"unknown config key {prefix}{name}{hint}"
        nested = fields[name].default_factory  # a section's dataclass, or MISSING, or a list's
        if not dataclasses.is_dataclass(nested):
            return None
        section, prefix = nested, f"{prefix}{name}."
    return None


def _deeper(name: str, section: type, prefix: str) -> str | None:
    """The keys of that name in the nearest sections below (`max_steps` -> `trainer.max_steps`):
    the section was left out, which a close spelling at this level does not find."""
    level = [(section, prefix)]
    while level:
        found, below = [], []
        for current, path in level:
            for field in dataclasses.fields(current):
                nested = field.default_factory
                if dataclasses.is_dataclass(nested):
                    inner = f"{path}{field.name}."
                    if name in {f.name for f in dataclasses.fields(nested)}:
                        found.append(f"{inner}{name}")
                    below.append((nested, inner))
        if found:
            return " or ".join(found)
        level = below
    return None
