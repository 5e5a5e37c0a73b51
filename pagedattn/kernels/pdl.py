"""Programmatic dependent launch (PDL, Hopper and later) between the kernels of one attention
call: `store_kv` -> `paged_attention` -> `reduce_splits`.

A kernel launched with PDL may start while the kernel before it in the stream still runs; its
programs then wait (`gdc_wait`) until that kernel has finished and its writes are visible, so
what overlaps is the launch and the programs' scheduling, not any work on the data. Each of the
three kernels also signals (`gdc_launch_dependents`) as soon as all its programs have started,
so the next launch is not held until the last one ends. Both instructions are no-ops in a
kernel launched without PDL, so the kernels stay correct after any other kernel, and a chain
stays ordered: a dependent cannot finish before its own wait, which follows its predecessor.

At a decode of one sequence the three launches are a few microseconds each against a kernel of
about ten; under CUDA graphs the dependencies are captured as programmatic edges.
`PAGEDATTN_PDL=0` turns it off (for comparison runs); it is off off-Hopper and under the
interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

from pagedattn.device_profile import DeviceProfile

from ._common import INTERPRET

ENABLED: bool = os.environ.get("PAGEDATTN_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (`use_pdl_on` its profile)."""
    return use_pdl_on(DeviceProfile.of(device))


@functools.lru_cache(maxsize=None)
def use_pdl_on(profile: DeviceProfile) -> bool:
    """Whether launches on a device of `profile` use PDL: compute capability 9 or later, not
    interpreted, a Triton with grid dependency control, and not turned off."""
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return ENABLED and not INTERPRET and hasattr(cuda, "gdc_wait") and profile.capability >= (9, 0)
