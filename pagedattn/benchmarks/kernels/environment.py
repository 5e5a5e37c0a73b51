"""The conditions of a run, recorded with its results: device, clocks, library versions."""

from __future__ import annotations

import datetime
import platform
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version

import torch
import triton

NVIDIA_SMI_FIELDS = ("name", "clocks.sm", "clocks.mem", "clocks.max.sm", "driver_version")


def _package_version(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def nvidia_smi() -> list[dict] | None:
    """One dict per GPU from `nvidia-smi --query-gpu=...` (clocks in MHz as printed), or None
    when nvidia-smi is absent or fails (the run goes on without clocks)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return [dict(zip(NVIDIA_SMI_FIELDS, (x.strip() for x in line.split(","))))
            for line in res.stdout.splitlines() if line.strip()]


def environment(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
        l2_bytes=getattr(props, "L2_cache_size", None), nvidia_smi=nvidia_smi(),
        torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
        flashinfer=_package_version("flashinfer-python", "flashinfer"), python=platform.python_version())
