"""`python -m pagedattn ...`: the same command line as the `pagedattn` console script."""

import sys

from pagedattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
