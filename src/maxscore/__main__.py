"""``python -m maxscore``: the ``maxscore`` command line (:func:`maxscore.cli.main`)."""

import sys

from maxscore.cli import main

if __name__ == "__main__":
    sys.exit(main())
