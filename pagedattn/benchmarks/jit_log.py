"""Triton compilations during a timed part of a benchmark, through Triton's JIT hooks.

A kernel variant first met inside a timed part compiles there (a second or more each) or loads
from Triton's disk cache; either way the run measures it. `CompileLog` records each such event
(kernel name, seconds into the part, how long it took) so a report can say whether a latency tail
is compilation. Without Triton, or a Triton without `triton.knobs.runtime`'s hooks, it records nothing
and says so (`available`).
"""

from __future__ import annotations

import time
from collections import Counter


class CompileLog:
    """`with CompileLog() as log: ...`; then `log.events`: [(kernel name, start s, seconds)] and
    `log.variants`: each compile's signature as Triton prints it (argument types and the value
    classes it specialised on, constexprs), to tell which variant a run met late."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self.variants: list[str] = []
        self.available = False
        self._runtime = None
        self._saved = (None, None)
        self._open: dict[object, tuple[str, float]] = {}
        self._t0 = 0.0

    def __enter__(self) -> CompileLog:
        self._t0 = time.perf_counter()
        try:
            from triton import knobs
        except ImportError:
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self._runtime, self.available = runtime, True
        self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved
            self._runtime = None

    def _before(self, *, key, fn, repr="", **_) -> bool:  # noqa: A002 - Triton's keyword
        self._open[id(key)] = (fn.name, time.perf_counter())
        self.variants.append(repr)
        return False  # go on and compile

    def _after(self, *, key, fn, **_) -> bool:
        name, start = self._open.pop(id(key), (fn.name, time.perf_counter()))
        self.events.append((name, start - self._t0, time.perf_counter() - start))
        return False

    def summary(self) -> dict:
        """{"available", "count", "seconds" (their total), "kernels": {name: count}, "events": [{name,
        at_s, seconds, variant}]} for a report."""
        return {"available": self.available, "count": len(self.events),
                "seconds": round(sum(s for _, _, s in self.events), 3),
                "kernels": dict(Counter(name for name, _, _ in self.events)),
                "events": [{"name": n, "at_s": round(at, 3), "seconds": round(sec, 3), "variant": v}
                           for (n, at, sec), v in zip(self.events, self.variants)]}
