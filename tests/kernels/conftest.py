"""Kernel tests run on the CPU under the Triton interpreter unless CUDA is present.

TRITON_INTERPRET must be set before triton (or pagedattn.kernels) is first imported, so it is
set here, at conftest import, when no GPU is available. Each test module starts with
`pytest.importorskip("triton")`, so without triton the directory is skipped with that reason.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Make the repository importable when the package is not installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
