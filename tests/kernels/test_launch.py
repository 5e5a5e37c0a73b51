"""`BoundKernel` (kernels/launch.py): which launches reuse a recorded binary and which go through
Triton's own path. A stand-in JIT function records both kinds of call; a wrong reuse (a binary
compiled for other dtypes, alignments or strides) would be a silent wrong result on the GPU."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from pagedattn.kernels import launch  # noqa: E402


class _Param(SimpleNamespace):
    pass


class _FakeJit:
    """Parameters (x_ptr, y_ptr, n, stride, BLOCK: constexpr); `n` is not specialised."""

    params = [_Param(name="x_ptr", is_constexpr=False, do_not_specialize=False),
              _Param(name="y_ptr", is_constexpr=False, do_not_specialize=False),
              _Param(name="n", is_constexpr=False, do_not_specialize=True),
              _Param(name="stride", is_constexpr=False, do_not_specialize=False),
              _Param(name="BLOCK", is_constexpr=True, do_not_specialize=False)]

    def __init__(self):
        self.jit_calls, self.fast_calls = [], []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            compiled = SimpleNamespace(packed_metadata="meta", function="fn",
                                       launch_metadata=lambda *a: None)
            compiled.run = lambda *a: self.fast_calls.append((compiled, a))
            return compiled
        return call


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRET", False)
    driver = SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                    get_current_stream=lambda device: 7))
    monkeypatch.setattr(launch, "_driver", driver)
    monkeypatch.setattr(launch, "_knobs", SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None,
                                                                                  launch_exit_hook=None)))
    return _FakeJit()


def test_reuses_the_binary_only_for_the_same_dtypes_alignment_and_strides(fake):
    k = launch.BoundKernel(fake, {"BLOCK": 64}, {"num_warps": 4})
    x, y = torch.zeros(64), torch.zeros(64)
    k((2,), x, y, 10, 16)
    assert len(fake.jit_calls) == 1 and fake.jit_calls[0][2] == {"BLOCK": 64, "num_warps": 4}
    k((3, 2), x, y, 11, 16)  # another grid and another unspecialised count: the same binary
    assert len(fake.jit_calls) == 1
    _, args = fake.fast_calls[-1]
    assert args[:4] == (3, 2, 1, 7) and args[-5:-1] == (x, y, 11, 16) and args[-1] == 64  # constexpr last
    k((2,), x.half(), y, 10, 16)  # another dtype: Triton's path (a new binary)
    k((2,), x, y, 10, 32)  # another stride value: likewise
    assert len(fake.jit_calls) == 3
    k((2,), x.half(), y, 10, 16)
    k((2,), x, y, 10, 32)
    assert len(fake.jit_calls) == 3 and len(fake.fast_calls) == 3
    shifted = torch.zeros(65)[1:]  # 4 bytes past an aligned start: never a recorded binary
    k((2,), shifted, y, 10, 16)
    k((2,), shifted, y, 10, 16)
    assert len(fake.jit_calls) == 5


def test_plain_launch_under_the_interpreter(fake, monkeypatch):
    monkeypatch.setattr(launch, "INTERPRET", True)
    k = launch.BoundKernel(fake, {"BLOCK": 64}, {})
    for _ in range(2):
        k((1,), torch.zeros(4), torch.zeros(4), 1, 1)
    assert len(fake.jit_calls) == 2 and not fake.fast_calls
