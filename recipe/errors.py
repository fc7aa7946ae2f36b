"""The recipe's own error types, importable from anywhere without pulling in the rest."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""
