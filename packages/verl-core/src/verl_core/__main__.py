"""``python -m verl_core``: the ``verl`` command, for an environment without its console script."""

import sys

from verl_core.cli import main

if __name__ == "__main__":
    sys.exit(main())
