"""The checks every schema field's `__post_init__` makes, with messages that name the field."""

from __future__ import annotations

from recipe.errors import ConfigError


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def positive(name: str, value: int | float) -> None:
    require(value > 0, f"{name} must be > 0, got {value}")


def one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")
