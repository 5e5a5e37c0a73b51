"""`BoundKernel`: a jitted kernel with its constexprs and launch options fixed, launched without
Triton's per-call argument binding once a specialisation has compiled.

`kernel[grid](*args, **constexprs)` binds every argument in Python on each call (types,
alignment and divisibility classes of ~60 arguments, a cache key string, a check of the
globals the kernel read): 20-40 us a launch on an H100 host, several launches a layer, every
layer of every step. A plan fixes the constexprs once per step, so a launch only has to find the
compiled binary for what can still vary between calls: the tensors' dtypes, whether every
pointer is 16-byte aligned and the values of the integer arguments Triton specialises on (strides: their classes
1 / multiple of 16 / other; the kernels mark the counts that change from step to step
`do_not_specialize`). That key is a tuple compare; a miss (a new alignment or stride class)
goes through Triton's own path once, which compiles or finds the binary and records it.

The launch itself is the compiled kernel's launcher, called as Triton's `run` calls it (the
same stream, launch hooks and scratch allocation), so profilers and CUDA-graph capture see the
same launch. Under `TRITON_INTERPRET=1` every call takes Triton's path.
"""

from __future__ import annotations

import operator

import torch

from ._common import INTERPRET

try:  # Triton's runtime knobs (launch hooks) and driver; absent in very old releases
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # pragma: no cover - the fast path needs both
    _knobs = _driver = None


class BoundKernel:
    """`fn` (a `@triton.jit` or Gluon function) with fixed `constexprs` and launch `options`
    (num_warps, num_stages, launch_pdl, maxnreg, ...). Call it with the grid and the runtime
    arguments, in the kernel's parameter order (every parameter before the constexprs)."""

    __slots__ = ("fn", "constexprs", "options", "_tail", "_binaries", "_tensor_pos", "_spec_pos", "_ints", "_fast")

    def __init__(self, fn, constexprs: dict, options: dict):
        self.fn, self.constexprs, self.options = fn, constexprs, options
        params = getattr(fn, "params", None)
        if params is None:  # not a JIT function (a test's stand-in): always the plain launch
            self._fast, self._tail, self._binaries, self._tensor_pos, self._spec_pos = False, (), {}, None, ()
            self._ints = None
            return
        runtime = [p for p in params if not p.is_constexpr]
        names = [p.name for p in params[len(runtime):]]
        # constexprs follow every runtime parameter (so the full argument list is args + tail)
        self._fast = (not INTERPRET and _knobs is not None and all(p.is_constexpr for p in params[len(runtime):])
                      and set(names) == set(constexprs))
        self._tail = tuple(constexprs[n] for n in names) if self._fast else ()
        self._binaries: dict[tuple, tuple] = {}
        self._tensor_pos: tuple[int, ...] | None = None
        self._spec_pos: tuple[int, ...] = ()
        self._ints = None  # an itemgetter of the specialised ints, when no other object is specialised

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        if not self._fast:
            self.fn[grid](*args, **self.constexprs, **self.options)
            return
        if self._tensor_pos is None:
            self._learn(args)
        key = self._key(args)
        binary = self._binaries.get(key) if key is not None else None
        if binary is None:
            kernel = self.fn[grid](*args, **self.constexprs, **self.options)  # compiles or finds it
            if key is not None and kernel is not None and hasattr(kernel, "packed_metadata"):
                self._binaries[key] = (kernel, kernel.run, kernel.function, kernel.packed_metadata)
            return
        kernel, run, function, packed = binary
        full = args + self._tail
        device = _driver.active.get_current_device()
        stream = _driver.active.get_current_stream(device)
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        meta = kernel.launch_metadata(grid, stream, *full) if enter is not None else None
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, stream, function, packed, meta, enter, leave, *full)

    def _learn(self, args: tuple) -> None:
        """Which positions hold tensors (their alignment keys the binary), which hold ints
        Triton specialises (their values key it) and which hold other objects (TMA
        descriptors: their block shape and strides key it)."""
        dont = {i for i, p in enumerate(self.fn.params) if getattr(p, "do_not_specialize", False)}
        self._tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self._spec_pos = tuple(i for i, a in enumerate(args)
                               if (isinstance(a, int) and not isinstance(a, bool) and i not in dont)
                               or not isinstance(a, (int, float, torch.Tensor)))
        if len(self._spec_pos) > 1 and all(isinstance(args[i], int) for i in self._spec_pos):
            self._ints = operator.itemgetter(*self._spec_pos)

    def _key(self, args: tuple) -> tuple | None:
        """What selects the binary: the tensors' dtypes (a pointer's element type is part of the
        signature) and the specialised values; None (take Triton's path, record nothing) unless
        every tensor argument is 16-byte aligned, as the binaries recorded here assume."""
        dtypes = []
        for i in self._tensor_pos:
            a = args[i]
            if not isinstance(a, torch.Tensor) or a.data_ptr() & 15:
                return None
            dtypes.append(a.dtype)
        if self._ints is not None:
            return (len(args), *dtypes, self._ints(args))
        return (len(args), *dtypes, *[_spec(args[i]) for i in self._spec_pos])


def _spec(a):
    """An argument's part of the key: an int's value; a TMA descriptor's block shape and strides
    (its base is 16-byte aligned by construction); None for an argument of another type."""
    if isinstance(a, int):
        return a
    shape = getattr(a, "block_shape", None)
    return None if shape is None else (tuple(shape), tuple(a.strides), a.base.dtype)


_bound: dict[tuple, BoundKernel] = {}


def bind(fn, constexprs: dict, options: dict) -> BoundKernel:
    """One `BoundKernel` per kernel configuration, shared by every plan that launches it."""
    key = (fn, tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
    bound = _bound.get(key)
    if bound is None:
        bound = _bound[key] = BoundKernel(fn, constexprs, options)
    return bound
