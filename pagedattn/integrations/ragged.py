"""Causal attention over ragged (variable-length) rows on a named pagedattn backend: the call
that FlashAttention's `flash_attn_varlen_func` makes, which is what transformers' attention
functions need (its paged cache hands over each sequence's keys as contiguous rows).

    attend = RaggedAttention("triton", num_heads=32, head_size=128, num_kv_heads=8, scale=128**-0.5)
    out = attend(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)   # [Tq, Hq, D]

Backends:
- `triton`: `pagedattn.flash_attn_interface.flash_attn_varlen_func`, one launch of our kernel
  (CUDA; the CPU under `TRITON_INTERPRET=1`). Nothing synchronises with the host.
- `torch`: the reference backend through the contract (API.md §2-3): the keys become a cache of
  one-token blocks, each sequence a `ScheduledSeq` whose query tokens are its last keys, so
  `impl.forward` sees a chunk over a cached prefix. Host lengths are read once per step (the
  step's layers pass the same, unchanged `cu_seqlens` tensors: `SameTensors`), so this path
  does not capture in CUDA graphs.

The layer's options are checked once, where the backend's contract checks them: constructing
the backend's `AttentionImpl` refuses a head size, window or soft cap the backend cannot run.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedattn.attention.registry import get_backend
from pagedattn.attention.types import ScheduledSeq

BACKENDS = ("triton", "torch")
"""Backends this adapter runs on: our kernels, and the PyTorch reference."""


class RaggedAttention:
    """One layer's causal, bottom-right aligned attention over ragged rows.

    backend: a name `pagedattn.get_backend` resolves ("auto" included) to one of `BACKENDS`.
    scale: softmax scale; sliding_window: W keys including the query's own (None: all);
    soft_cap: c in c * tanh(s / c) (None: off).
    """

    def __init__(self, backend: str, *, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, soft_cap: float | None = None):
        backend_cls = get_backend(backend)
        self.backend = backend_cls.get_name()
        if self.backend not in BACKENDS:
            raise ValueError(f"expected a backend in {list(BACKENDS)} for ragged attention, got {self.backend!r} "
                             f"(from {backend!r})")
        # the backend's own checks of the layer's options, with their reasons
        self.impl = backend_cls.get_impl_cls()(num_heads, head_size, scale, num_kv_heads,
                                               sliding_window=sliding_window, logits_soft_cap=soft_cap)
        self.builder_cls = backend_cls.get_builder_cls()
        self.scale, self.sliding_window, self.soft_cap = scale, sliding_window, soft_cap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        """q: [Tq, Hq, D]; k, v: [Tk, Hkv, D], q's dtype and device; cu_seqlens_q/_k: int32 [B+1]
        (sequence b: query rows cu_seqlens_q[b].., key rows cu_seqlens_k[b].., no more queries
        than keys); max_seqlen_q/_k: host ints bounding them. Returns [Tq, Hq, D]."""
        if self.backend == "triton":
            from pagedattn.flash_attn_interface import flash_attn_varlen_func

            window = (-1, -1) if self.sliding_window is None else (self.sliding_window - 1, 0)
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          softmax_scale=self.scale, causal=True, window_size=window,
                                          softcap=self.soft_cap or 0.0)
        return self._through_contract(q, k, v, cu_seqlens_q, cu_seqlens_k)

    def _through_contract(self, q, k, v, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ValueError("ragged attention on the torch backend: expected inputs without requires_grad "
                             "(forward only; call it under torch.no_grad() or torch.inference_mode())")
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the torch backend's ragged attention reads lengths on the host and cannot be "
                               "captured in a CUDA graph; use the triton backend")
        step = _Step.of(cu_seqlens_q, cu_seqlens_k, self.sliding_window, self.builder_cls, q.device)
        kv_cache = torch.stack((k, v)).unsqueeze(2)  # [2, Tk, 1, Hkv, D]: block i holds key row i
        out = torch.empty_like(q)
        out[step.q_rows] = self.impl.forward(q[step.q_rows], k[step.new_k_rows], v[step.new_k_rows], kv_cache,
                                             step.md).view(-1, *q.shape[1:])
        return out


class SameTensors:
    """Values derived from device tensors (lengths read on the host, which synchronises), kept
    while later calls pass the same tensors again: a model's layers make the same calls one after
    another with one step's tensors (a few sets of them: one per layer type of a hybrid model).

    Same: the same objects (held here, so an id is never reused), at the same version (any
    in-place write bumps it), with equal `extra`. Inference tensors keep no version, so they
    never match and their value is derived on every call.
    """

    def __init__(self, slots: int = 4) -> None:
        self._slots = slots
        self._entries: list[tuple] = []  # (tensors, versions, extra, value), most recent last

    def get(self, tensors: tuple, extra, derive):
        """tensors: a tuple of tensors or None; extra: anything else the value depends on (==);
        derive: () -> the value, called unless an entry has the same tensors and extra."""
        versions = _versions(tensors)
        if versions is not None:
            for entry in reversed(self._entries):
                if entry[1] == versions and entry[2] == extra and all(a is b for a, b in zip(entry[0], tensors)):
                    return entry[3]
        value = derive()
        if versions is not None:
            self._entries = [*self._entries[1 - self._slots:], (tensors, versions, extra, value)]
        return value


def _versions(tensors: tuple) -> tuple | None:
    if any(t is not None and t.is_inference() for t in tensors):
        return None
    return tuple(None if t is None else t._version for t in tensors)


class _Step:
    """The metadata of one ragged call for the torch backend, and the row orders it needs (prefills
    first, as the contract wants). Kept while the step's lengths stay: a model's layers make the
    same call one after another (with a window or without, layer by layer in a hybrid model)."""

    _lengths = SameTensors()  # the step's cu_seqlens tensors -> their host lists, read once
    _steps: ClassVar[dict] = {}  # (lengths, window, builder, device) -> _Step: a step's layer types, a few steps

    def __init__(self, q_rows: torch.Tensor, new_k_rows: torch.Tensor, md):
        self.q_rows, self.new_k_rows, self.md = q_rows, new_k_rows, md

    @classmethod
    def of(cls, cu_seqlens_q, cu_seqlens_k, sliding_window, builder_cls, device) -> _Step:
        cu_q, cu_k = cls._lengths.get((cu_seqlens_q, cu_seqlens_k), None,
                                      lambda: (tuple(cu_seqlens_q.tolist()), tuple(cu_seqlens_k.tolist())))
        key = (cu_q, cu_k, sliding_window, builder_cls, device)
        step = cls._steps.get(key)
        if step is None:
            step = cls._build(cu_q, cu_k, sliding_window, builder_cls, device)
            if len(cls._steps) >= 8:
                cls._steps.clear()  # earlier steps' metadata, done with
            cls._steps[key] = step
        return step

    @classmethod
    def _build(cls, cu_q: tuple[int, ...], cu_k: tuple[int, ...], sliding_window, builder_cls, device) -> _Step:
        seqs = []
        for b in range(len(cu_q) - 1):
            q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            if q_len > k_len:
                raise ValueError(f"sequence {b}: expected no more queries than keys, got {q_len} and {k_len}")
            if q_len:
                seq = ScheduledSeq(seq_len=k_len, query_len=q_len, block_table=range(cu_k[b], cu_k[b + 1]))
                seqs.append((not seq.is_prefill, seq, range(cu_q[b], cu_q[b + 1]),
                             range(cu_k[b + 1] - q_len, cu_k[b + 1])))
        seqs.sort(key=lambda s: s[0])  # prefills first (a stable sort keeps the rest in order)
        md = builder_cls(1, device, sliding_window=sliding_window).build([s[1] for s in seqs])
        rows = lambda i: torch.tensor([r for s in seqs for r in s[i]], dtype=torch.long, device=device)  # noqa: E731
        return cls(rows(2), rows(3), md)
