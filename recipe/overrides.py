"""Let `cp=2` select the config group option `cp/2.yaml`.

Hydra parses `cp=2` as an integer and refuses it as a group choice ("Config group override must be
a string"). Quoting the value on the way in keeps the documented command line (`cp=2`,
`-m cp=1,2,4`) working; everything else is passed through untouched.
"""

from __future__ import annotations

import re

NUMERIC_GROUPS = ("cp",)
_NUMBER_LIST = re.compile(r"^\d+(,\d+)*$")


def quote_numeric_group_choices(
    args: list[str], groups: tuple[str, ...] = NUMERIC_GROUPS
) -> list[str]:
    """Rewrite `cp=2` to `cp='2'` and `cp=1,2,4` to `cp='1','2','4'` for the given groups."""
    rewritten = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in groups and _NUMBER_LIST.match(value):
            value = ",".join(f"'{choice}'" for choice in value.split(","))
            arg = f"{key}={value}"
        rewritten.append(arg)
    return rewritten
