"""``python -m pipeload``: the same as the ``pipeload`` command."""

import sys

from pipeload.cli import main

if __name__ == "__main__":
    sys.exit(main())
