"""`python -m recipe.check_preprocess`: the property check of a CP preprocessing function (the body
is `recipe.checks.preprocess`)."""

import sys

from recipe.checks.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
