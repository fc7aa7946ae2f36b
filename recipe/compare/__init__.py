"""Judging runs against each other: runs, step-by-step diffs, the parity report and its plot.

`python -m recipe.compare RUN_DIR...` is the command line; `recipe.compare.sweep` ends every
Hydra multirun with the same report.
"""
