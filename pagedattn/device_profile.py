"""`DeviceProfile`: the facts of a device that kernel policies and capabilities depend on, read
once per device.

Tiles, split counts and which kernels may run are functions of these facts, never of a GPU's
name: shared memory a program may hold bounds the tiles (an A10 or an RTX 4090 allows 99 KiB,
an A100 163 KiB, an H100 227 KiB), the SM count sizes grids and splits, the bandwidth per SM
says how many bytes a decode program must keep in flight, and the compute capability says
which instructions exist (FP8 e4m3 conversions from sm_89, TMA and warpgroup MMAs on sm_90).

`DeviceProfile.of(device)` reads a CUDA device through `torch.cuda.get_device_properties`
(memory bandwidth from the memory clock and bus width it reports: 2 transfers a clock, as
HBM and GDDR6 count them); off CUDA it is the `cpu` profile (the interpreter has no occupancy
and no shared-memory limit). `PRESETS` holds the same facts for the GPUs people run, from their
datasheets, so policies and compiles can be checked for targets that are not here (tests fake a
device with them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceProfile:
    """What one device offers the kernels. Byte counts are bytes; bandwidth is GB/s."""

    name: str
    capability: tuple[int, int]  # (major, minor); (0, 0) off CUDA
    num_sms: int
    smem_per_block: int  # shared memory one program may hold (the opt-in limit)
    smem_per_sm: int
    regs_per_sm: int
    l2_bytes: int
    bandwidth_gbs: float  # DRAM bandwidth, read + write counted once (0: unknown)
    triton_version: str = ""

    @property
    def is_cuda(self) -> bool:
        return self.capability >= (7, 0)

    @property
    def fp8_e4m3(self) -> bool:
        """Whether our kernels compile FP8 e4m3 (`fp8e4nv`) loads here: sm_89 and later."""
        return not self.is_cuda or self.capability >= (8, 9)

    @property
    def fp8_e5m2(self) -> bool:
        """FP8 e5m2 converts through fp16 bit patterns: any GPU our kernels run on."""
        return True

    @property
    def tma(self) -> bool:
        """The bulk tensor copy engine (TMA): sm_90 and later."""
        return self.capability >= (9, 0)

    @property
    def wgmma(self) -> bool:
        """Hopper's asynchronous warpgroup MMAs: sm_90 only (Blackwell has its own)."""
        return self.capability == (9, 0)

    @property
    def bandwidth_per_sm_gbs(self) -> float:
        """DRAM bandwidth one SM's programs must draw to keep the device busy."""
        return self.bandwidth_gbs / max(1, self.num_sms)

    def __hash__(self) -> int:  # plans are memoised on launch facts that hold the profile
        return hash((self.name, self.capability, self.num_sms, self.smem_per_block))

    def fits(self, smem_bytes: int) -> bool:
        """Whether a program holding `smem_bytes` of shared memory launches here."""
        return smem_bytes <= self.smem_per_block

    def with_(self, **changes) -> DeviceProfile:
        """This profile with some facts changed (tests fake devices with it)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def of(device: torch.device | str | None = None) -> DeviceProfile:
        """The profile of `device` (default: the current CUDA device, else the CPU), read once."""
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cuda":
            return CPU
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_profile(index)


def _triton_version() -> str:
    """The installed Triton's version, read from its metadata: importing triton here would fix
    its interpreter mode before a test or user sets TRITON_INTERPRET (and pagedattn imports no
    optional dependency)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=None)
def _cuda_profile(index: int) -> DeviceProfile:
    p = torch.cuda.get_device_properties(index)
    clock_khz = getattr(p, "memory_clock_rate", 0)
    bus_bits = getattr(p, "memory_bus_width", 0)
    bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else 0.0
    return DeviceProfile(
        name=p.name, capability=(p.major, p.minor), num_sms=p.multi_processor_count,
        smem_per_block=getattr(p, "shared_memory_per_block_optin", 48 * 1024),
        smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", 64 * 1024),
        regs_per_sm=getattr(p, "regs_per_multiprocessor", 65536), l2_bytes=getattr(p, "L2_cache_size", 0),
        bandwidth_gbs=round(bandwidth, 1), triton_version=_triton_version())


# Off CUDA: the PyTorch reference, or the Triton interpreter (one "SM", no shared-memory limit).
CPU = DeviceProfile(name="cpu", capability=(0, 0), num_sms=1, smem_per_block=1 << 30, smem_per_sm=1 << 30,
                    regs_per_sm=1 << 30, l2_bytes=0, bandwidth_gbs=0.0, triton_version=_triton_version())

_KIB = 1024
# Datasheet facts (CUDA occupancy tables for shared memory and registers); the H100's and
# H200's agree with what `of` reads on them (H100 80GB HBM3: 132 SMs, 232,448 B a block,
# 50 MiB L2, 2,619 MHz x 5,120 bits = 3,352 GB/s).
PRESETS: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("a100", (8, 0), 108, 163 * _KIB, 164 * _KIB, 65536, 40 * _KIB * _KIB, 2039.0),
    DeviceProfile("a10", (8, 6), 72, 99 * _KIB, 100 * _KIB, 65536, 6 * _KIB * _KIB, 600.0),
    DeviceProfile("rtx3090", (8, 6), 82, 99 * _KIB, 100 * _KIB, 65536, 6 * _KIB * _KIB, 936.0),
    DeviceProfile("l4", (8, 9), 58, 99 * _KIB, 100 * _KIB, 65536, 48 * _KIB * _KIB, 300.0),
    DeviceProfile("l40s", (8, 9), 142, 99 * _KIB, 100 * _KIB, 65536, 96 * _KIB * _KIB, 864.0),
    DeviceProfile("rtx4090", (8, 9), 128, 99 * _KIB, 100 * _KIB, 65536, 72 * _KIB * _KIB, 1008.0),
    DeviceProfile("h100", (9, 0), 132, 227 * _KIB, 228 * _KIB, 65536, 50 * _KIB * _KIB, 3352.0),
    DeviceProfile("h200", (9, 0), 132, 227 * _KIB, 228 * _KIB, 65536, 60 * _KIB * _KIB, 4800.0),
)}
