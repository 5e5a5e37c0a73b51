"""Kernel tests run on the CPU under the Triton interpreter unless CUDA is present.

TRITON_INTERPRET must be set before triton (or pagedattn.kernels) is first imported, so it is
set here, at conftest import, when no GPU is available. Each test module starts with
`pytest.importorskip("triton")`, so without triton the directory is skipped with that reason.
The backend fixture's availability was read before this (tests/conftest.py), so setting it
here does not turn the triton backend on for the other folders of the same run.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
