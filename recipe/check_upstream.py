"""`python -m recipe.check_upstream`: released upstream CP code against the ground truth (the body
is `recipe.checks.upstream`)."""

import sys

from recipe.checks.upstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
