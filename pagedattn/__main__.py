"""`python -m pagedattn ...`: the same command line as the `pagedattn` console script."""

from pagedattn.cli import entry_point

if __name__ == "__main__":
    entry_point()
