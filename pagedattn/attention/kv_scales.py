"""One layer's FP8 cache scales in the forms the kernels read, made once per layer.

`impl.forward` takes `k_scale`/`v_scale` as Python floats or 0-dim float32 tensors (API.md
section 3). Kernels want 0-dim float32 tensors on the cache's device (a pointer load keeps CUDA
graphs valid when the value changes in place); FlashInfer's `run` wants Python floats. This
object gives both without a per-layer allocation or a per-step host synchronisation:
- a float becomes a device tensor once (again only when the value changes);
- a tensor on the right device in float32 is used as it is; another is copied to the device
  once per in-place change (its version counter moves);
- the host float of a tensor is read once per in-place change (one synchronisation), never
  during a CUDA-graph capture (`host()` answers None there, and the caller applies the tensor).
"""

from __future__ import annotations

import torch

Scale = float | torch.Tensor


class _OneScale:
    def __init__(self, name: str):
        self.name = name
        self.source: Scale | None = None
        self.version = -1
        self.device_value: torch.Tensor | None = None  # 0-dim float32 on the cache's device
        self.host_value: float | None = None

    def update(self, scale: Scale, device: torch.device) -> torch.Tensor:
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1 or not scale.dtype.is_floating_point:
                raise ValueError(
                    f"expected {self.name} as a float or a 0-dim float32 tensor, got {scale.dtype} {list(scale.shape)}")
            if scale.device == device and scale.dtype == torch.float32 and scale.dim() == 0:
                if scale is not self.source or scale._version != self.version:
                    self.source, self.version, self.host_value = scale, scale._version, None
                self.device_value = scale
                return scale
            if scale is self.source and scale._version == self.version and self.device_value.device == device:
                return self.device_value
            self.source, self.version, self.host_value = scale, scale._version, None
            self.device_value = scale.detach().reshape(()).to(device=device, dtype=torch.float32)
            return self.device_value
        value = float(scale)
        same = isinstance(self.source, float) and self.source == value
        if not same or self.device_value.device != device:
            self.source, self.version, self.host_value = value, -1, value
            self.device_value = torch.full((), value, dtype=torch.float32, device=device)
        return self.device_value

    def host(self) -> float | None:
        if self.host_value is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            self.host_value = float(self.device_value)
        return self.host_value


class KVScales:
    """The FP8 scales of one layer: `k`, `v` (0-dim float32 device tensors) after `update`."""

    def __init__(self) -> None:
        self._k = _OneScale("k_scale")
        self._v = _OneScale("v_scale")
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k_scale: Scale, v_scale: Scale, device: torch.device) -> KVScales:
        """Take this step's scales (floats or tensors) for a cache on `device`."""
        self.k = self._k.update(k_scale, device)
        self.v = self._v.update(v_scale, device)
        return self

    def host(self) -> tuple[float | None, float | None]:
        """(k, v) as Python floats; a tensor is read once per in-place change, and an entry is
        None while a CUDA graph is being captured and the value was not read before."""
        return self._k.host(), self._v.host()
