"""Shared pytest options and fixtures.

    pytest tests --backend torch --device cpu        (the defaults)
    pytest tests --backend triton --device cuda

`backend` is the class `pagedattn.get_backend(--backend)` returns; a backend that cannot run
here skips its tests with the registry's reason. fp16 and bf16 are ordinary dtypes on the CPU
too (torch implements them), so dtype grids are not restricted to the GPU; the per-dtype
tolerances live in oracle.py (`tolerance_for`), the dtype names in `oracle.DTYPES`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS):  # the package from this checkout; oracle.py / cases.py as modules
    if _p not in sys.path:
        sys.path.insert(0, _p)



def pytest_addoption(parser):
    group = parser.getgroup("pagedattn")
    group.addoption("--backend", default="torch",
                    help="attention backend under test: torch, triton, flash_attn, flashinfer, "
                         "xformers or auto (default: torch)")
    group.addoption("--device", default="cpu", help="device to run on: cpu or cuda (default: cpu)")
    group.addoption("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                    help="model dtype of the tests that do not sweep dtypes (default: fp32, or "
                         "bf16 when the backend refuses fp32)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_only: needs --device cuda (cross-device cache operations, graphs)")
    config.addinivalue_line(
        "markers", "slow: compiles or runs a larger grid; still part of the default run")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device").startswith("cuda"):
        return
    skip = pytest.mark.skip(reason="needs --device cuda")
    for item in items:
        if "cuda_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def backend_name(pytestconfig) -> str:
    return pytestconfig.getoption("--backend")


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    dev = torch.device(pytestconfig.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but torch sees no CUDA device")
    return dev


@pytest.fixture(scope="session")
def backend(backend_name, device, pytestconfig):
    import pagedattn

    import cases
    from oracle import DTYPES

    try:
        b = pagedattn.get_backend(backend_name)
    except pagedattn.BackendUnavailableError as e:
        pytest.skip(f"backend {backend_name!r} is unavailable here: {e}")
    name = pytestconfig.getoption("--dtype")
    if name == "auto":
        name = next((n for n in ("fp32", "bf16", "fp16")
                     if cases.dtype_refusal(b, device, DTYPES[n]) is None), "fp32")
    cases.DEFAULT_DTYPE["dtype"] = DTYPES[name]
    return b


@pytest.fixture(scope="session")
def model_dtype(backend) -> torch.dtype:
    """The dtype tests use when they do not sweep dtypes (see --dtype)."""
    import cases

    return cases.default_dtype()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
