"""Released upstream CP code, loaded from its PyPI wheels and checked (`recipe.check_upstream`)."""
