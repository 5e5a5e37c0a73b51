"""The device's ceilings, measured in the same run as the kernels (datasheet rates are leads).

- copy: device-to-device copy of a 2 GiB bf16 buffer (40x an H100's L2), bytes read + written.
- read: a float32-accumulated sum over the same buffer, bytes read; a decode kernel only reads,
  and pure reads can run a little faster than a copy.
- matmul: 8192^3 bf16 matrix product on random data (never zeros: they run faster).
Each is the median of CUDA-event-timed repetitions after a warm-up.
"""

from __future__ import annotations

import torch

from pagedattn.cuda_timing import median_event_ms

COPY_BYTES = 2 << 30
MATMUL_N = 8192


def measure_ceilings(device: torch.device) -> dict:
    """{'copy_gbs', 'read_gbs', 'matmul_tflops'} of `device`, decimal units."""
    n = COPY_BYTES // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_event_ms(lambda: dst.copy_(src), reps=20)
    read_ms = median_event_ms(lambda: src.sum(dtype=torch.float32), reps=20)
    del src, dst
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    mm_ms = median_event_ms(lambda: a @ b, reps=20)
    del a, b
    torch.cuda.empty_cache()
    return dict(copy_gbs=2 * COPY_BYTES / copy_ms / 1e6, read_gbs=COPY_BYTES / read_ms / 1e6,
                matmul_tflops=2 * MATMUL_N ** 3 / mm_ms / 1e9)
