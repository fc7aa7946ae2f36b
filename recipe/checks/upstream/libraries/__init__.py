"""One plugin per library: its data (files, options drawn and fixed, releases) and its checked
class; each is registered in one line in `recipe/checks/upstream/registry.py`."""
