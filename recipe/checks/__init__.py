"""The proof tools, as importable bodies: `preprocess` (a CP function's property check),
`upstream/` (released libraries' functions, one plugin each), `mtp_roll` (megatron-core's MTP
roll on real ranks), `gpu` (the GPU path on one GPU); `search` is the search they shrink findings
with, `arguments` the option types their command lines share. Their command lines keep their
spelling through thin entry points: `python -m recipe.check_preprocess`, `python -m
recipe.check_upstream`, `scripts/gpu_check.py`."""
