"""Shared pytest options and fixtures.

    pytest tests                                     (every backend; the CPU by default)
    pytest tests/backend --backend torch,triton      (a filter: a comma list of names)
    pytest tests/backend tests/gpu --backend triton --device cuda

On the CPU our Triton kernels run interpreted (a second or more a launch), so grid cells marked
`gpu_grid(keep=...)` (cases.py: `KERNEL_GRID`, `GPU_ONLY_GRID`) run there only for the backends
named in `keep` (and the torch backend, which runs no Triton): cells whose code path the
unmarked cells already take, such as a second head size of the same kernel behind the
flash_attn and xformers adapters. With --device cuda every cell runs.

Every test that takes `backend` (or `backend_name`) runs once per backend that
`pagedattn.list_backends()` names and `--backend` keeps; one that cannot run here is reported
as a skip with the registry's reason. Availability is read once, as the session starts (the
kernel tests set TRITON_INTERPRET later, for themselves). `model_dtype` follows each backend:
fp32, or bf16 when the backend refuses fp32 (see --dtype). fp16 and bf16 are ordinary dtypes
on the CPU too, so dtype grids are not restricted to the GPU; the per-dtype tolerances live in
oracle.py (`tolerance_for`).
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch

import pagedattn
from cases import model_dtype_for

# Read when this file is imported, before any folder's conftest: tests/kernels sets
# TRITON_INTERPRET for its own kernel tests, which must not turn the triton backend on for the
# other folders of the same run (whatever paths the command line lists).
_REASONS = {s.name: s.reasons for s in pagedattn.list_backends()}
_AUTO = pagedattn.get_backend("auto").get_name()
_STATUS = pytest.StashKey[dict]()  # selected backend name -> reasons it cannot run


def pytest_addoption(parser):
    group = parser.getgroup("pagedattn")
    group.addoption("--backend", default="all",
                    help="attention backends under test, a comma list of names from "
                         "pagedattn.list_backends() (or auto), default all; unavailable ones "
                         "are reported as skips")
    group.addoption("--device", default="cpu", help="device to run on: cpu or cuda (default: cpu)")
    group.addoption("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                    help="model dtype of the tests that do not sweep dtypes (default: fp32, or "
                         "bf16 when the backend refuses fp32)")


def _selected_backends(option: str) -> dict[str, list[str]]:
    statuses = _REASONS
    if option == "all":
        return statuses
    chosen = {}
    for name in (n.strip() for n in option.split(",") if n.strip()):
        if name == "auto":
            name = _AUTO
        if name not in statuses:
            raise pytest.UsageError(
                f"--backend: expected names from {sorted(statuses)} (or auto, all), got {name!r}")
        chosen[name] = statuses[name]
    return chosen


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_only: needs --device cuda (cross-device cache operations, graphs)")
    config.addinivalue_line(
        "markers", "gpu_grid(keep=()): on the CPU (our kernels interpreted) run only for the backends in keep "
                   "and the torch backend; with --device cuda always (see the module doc)")
    config.stash[_STATUS] = _selected_backends(config.getoption("--backend"))
    _sigint_default_at_start(config)


def _sigint_default_at_start(config):
    """A session started with SIGINT ignored (a background job of a non-interactive shell: `cmd &`
    sets SIG_IGN, and Python then installs no handler) is said once, here, and the default is
    restored, so that the Ctrl-C tests run and `_sigint_handler_kept` names only a test that
    really changed it (before this the first test was blamed, 2026-11-27, f3ced6c)."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config.issue_config_time_warning(pytest.PytestConfigWarning(
        f"this pytest session was started with SIGINT's handler at {handler!r}, not Python's "
        "default (SIGINT ignored: started as a background job, `cmd &`, of a non-interactive "
        "shell?); restored the default for the session, so the Ctrl-C tests run"), stacklevel=2)


def pytest_runtest_logreport(report):
    """PAGEDATTN_FAIL_LOG=path: every failure appended to path when it happens, not only in the
    summary at the end (a GPU run cut by its time limit keeps its failures)."""
    path = os.environ.get("PAGEDATTN_FAIL_LOG")
    if path and report.failed and getattr(report, "node", None) is None:  # xdist: the worker's copy
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_generate_tests(metafunc):
    if "backend_name" in metafunc.fixturenames:
        names = list(metafunc.config.stash[_STATUS])
        metafunc.parametrize("backend_name", names, indirect=True, scope="session")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device").startswith("cuda"):
        return
    skip = pytest.mark.skip(reason="needs --device cuda")
    for item in items:
        if "cuda_only" in item.keywords:
            item.add_marker(skip)
        grid = item.get_closest_marker("gpu_grid")
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend_name") if callspec else None
        if grid is not None and backend != "torch" and backend not in grid.kwargs.get("keep", ()):
            item.add_marker(pytest.mark.skip(
                reason="gpu_grid: under the Triton interpreter the cells left in take this code path; "
                       "runs with --device cuda"))


@pytest.fixture(scope="session")
def backend_name(request) -> str:
    """A backend name from `pagedattn.list_backends()` (parametrised; see the module doc)."""
    name = request.param
    reasons = request.config.stash[_STATUS][name]
    if reasons:
        pytest.skip(f"backend {name!r} is unavailable here: {'; '.join(reasons)}")
    return name


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    dev = torch.device(pytestconfig.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but torch sees no CUDA device")
    if dev.type == "cuda":
        # Tests hold float32 results to float32 references (often computed on the CPU): no
        # TF32, which cuDNN's convolutions use by default (Whisper's front end) and which
        # random tiny models amplify into different greedy tokens.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return dev


@pytest.fixture(scope="session")
def backend(backend_name):
    """The backend class `pagedattn.get_backend(backend_name)`."""
    return pagedattn.get_backend(backend_name)


@pytest.fixture(scope="session")
def model_dtype(backend, device, pytestconfig) -> torch.dtype:
    """The dtype tests use when they do not sweep dtypes (see --dtype)."""
    return model_dtype_for(backend, device, pytestconfig.getoption("--dtype"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _sigint_handler_kept(request):
    """Every test starts with Python's own SIGINT handler (`_sigint_default_at_start` sets it for
    the session), and one that leaves another is named: an ignored SIGINT is inherited by every
    process a later test starts (Ctrl-C tests then see nothing)."""
    yield
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler at {signal.getsignal(signal.SIGINT)!r}; "
                      "restored", stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
