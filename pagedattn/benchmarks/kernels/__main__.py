"""`python -m pagedattn.benchmarks.kernels`: the same as `pagedattn bench kernels`."""

from pagedattn.benchmarks.kernels import main

raise SystemExit(main(prog="python -m pagedattn.benchmarks.kernels"))
