"""`python -m pagedattn ...`: the same command line as the `pagedattn` console script."""

import sys

from pagedattn.cli import main

sys.exit(main())
