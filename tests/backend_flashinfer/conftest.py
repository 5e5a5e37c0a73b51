"""FlashInfer-specific tests: they need a CUDA GPU and the flashinfer package (skipped otherwise).

    pytest tests/backend_flashinfer            (on the GPU machine; FlashInfer JIT-compiles on first use)
"""

from __future__ import annotations

import pytest
import torch

REASON = "needs CUDA and flashinfer"


@pytest.fixture(autouse=True)
def _needs_cuda_and_flashinfer():
    pytest.importorskip("flashinfer", reason=REASON)
    if not torch.cuda.is_available():
        pytest.skip(REASON)


@pytest.fixture
def fi():
    import pagedattn

    return pagedattn.get_backend("flashinfer")


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
