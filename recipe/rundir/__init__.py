"""Run directories: the name of every file in one, and the readers and writers of those files.

A run directory is the contract between training, the launcher and the comparison: `layout` names
its files, `claim` locks it for one job, `job_files` writes `.hydra/`, `metrics`, `tokens` and
`traces` read and write what a run records. Nothing outside this package spells a file name of it.
"""
