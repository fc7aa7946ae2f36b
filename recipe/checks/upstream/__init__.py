"""`python -m recipe.check_upstream`: released libraries' CP code against the ground truth.

`kit/` is what every library shares (the checked-function interface, the Registry, the stand-ins
and references, the functions training can call as checked functions); `libraries/` holds one
plugin per library; `registry.py` registers each in one line; `runner.py` searches one
library's functions for their worst finding, `table.py` every registered release (`--all`),
`cli.py` is the command line. docs/upstream.md says how to add a library.
"""
