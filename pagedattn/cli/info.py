"""`pagedattn info`: devices, versions, and every backend with its availability and reasons."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys


def add_parser(sub) -> None:
    """Register `info` on `sub`, the `add_subparsers()` object of the `pagedattn` parser."""
    sub.add_parser("info", help="devices, versions and backends").set_defaults(run=run)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(_args: argparse.Namespace) -> int:
    import torch

    import pagedattn
    from pagedattn.device_profile import DeviceProfile
    from pagedattn.parallel.all_reduce import planned

    print(f"pagedattn {pagedattn.__version__}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {_version('triton')}, "
          f"flashinfer {_version('flashinfer-python')}, xformers {_version('xformers')}, "
          f"transformers {_version('transformers')}")
    print("devices:")
    print("  cpu")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            d = DeviceProfile.of(torch.device("cuda", i))
            print(f"  cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}; "
                  f"{d.num_sms} SMs, {d.smem_per_block // 1024} KiB shared memory a program, "
                  f"{d.l2_bytes >> 20} MiB L2, {d.bandwidth_gbs:.0f} GB/s; FP8 e4m3 {'yes' if d.fp8_e4m3 else 'no'}, "
                  f"TMA {'yes' if d.tma else 'no'}, wgmma {'yes' if d.wgmma else 'no'}")
    else:
        print("  (no CUDA device)")
    print("backends:")
    for status in pagedattn.list_backends():
        if status.available:
            via = f" (via {status.provider})" if status.provider and status.provider != status.name else ""
            print(f"  {status.name:<11} available{via}")
        else:
            print(f"  {status.name:<11} unavailable: {'; '.join(status.reasons)}")
    try:
        auto = pagedattn.get_backend("auto").get_name()
    except pagedattn.BackendUnavailableError as e:
        auto = f"none ({e})"
    print(f"auto -> {auto}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        print(f"tensor-parallel all-reduce over {gpus} GPUs: {planned(torch.device('cuda', 0), gpus)}")
    else:
        print(f"tensor-parallel all-reduce: {planned(torch.device('cpu'), 2)}")
    return 0
