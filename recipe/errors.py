"""The recipe's own error types, importable from anywhere without pulling in the rest.

Every error the recipe reports in one line (instead of a traceback) derives from RecipeError and
carries its exit code, so the entry point maps failures to exit codes in one place.
"""


class RecipeError(Exception):
    """An error whose message says what happened and what to do; the job exits with exit_code."""

    exit_code = 1


class ConfigError(RecipeError, ValueError):
    """A configuration value that cannot work; the message names the field and the fix."""

    exit_code = 2


class StepRefused(RecipeError, RuntimeError):
    """The step guard stopped the run: a step's loss or gradient norm was non-finite
    (trainer.on_nonfinite=stop) or a spike (trainer.loss_spike.action=stop). The weights stay
    at the step before."""
