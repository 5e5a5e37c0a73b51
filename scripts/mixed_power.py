"""On a GPU: does a mixed step slow down when called back to back, and is it the clock?

Runs the `bench kernels` mixed case "2k chunk over 2k + 64 decodes" (32/8/128) raw and through
FlashInfer, each for 2 s back to back and 2 s with 0.3 ms of idle device time between calls,
sampling the SM clock and board power (nvidia-smi, every 100 ms) during each phase.

    python scripts/mixed_power.py
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

from pagedattn.benchmarks.kernels import cases as C
from pagedattn.benchmarks.kernels.peers import prepare_flashinfer
from pagedattn.benchmarks.kernels.raw import prepare_raw
from pagedattn.benchmarks.kernels.workload import make_workload

PHASE_S = 2.0
GAP_MS = 0.3
SLEEP_CYCLES_PER_MS = 1.7e6  # `torch.cuda._sleep` spins for cycles: about 0.3 ms at Hopper's clocks


def phase(call, gap_ms: float) -> tuple[float, list[tuple[float, float]]]:
    """(median us a call, [(SM MHz, W)] samples) of PHASE_S seconds of `call`."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    events, end = [], time.time() + PHASE_S
    while time.time() < end:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        if gap_ms:
            torch.cuda._sleep(int(gap_ms * SLEEP_CYCLES_PER_MS))
        events.append((start, stop))
        if len(events) % 64 == 0:
            events[-64][1].synchronize()  # keep the host at most 64 calls ahead
    torch.cuda.synchronize()
    smi.terminate()
    samples = [tuple(float(x) for x in line.split(",")) for line in smi.stdout.read().splitlines() if "," in line]
    times = [a.elapsed_time(b) * 1e3 for a, b in events[10:]]
    return statistics.median(times), samples


def main() -> None:
    device = torch.device("cuda")
    case = next(c for c in C.mixed_cases() if "64 decodes" in c.name)
    w = make_workload(case, device, 1)
    for name, prepare in (("ours (raw)", lambda: prepare_raw(w)), ("FlashInfer", lambda: prepare_flashinfer(w, False))):
        step = prepare()
        for _ in range(5):
            step.calls[0]()
        torch.cuda.synchronize()
        for gap in (0.0, GAP_MS):
            us, samples = phase(step.calls[0], gap)
            clock = [s[0] for s in samples] or [float("nan")]
            power = [s[1] for s in samples] or [float("nan")]
            print(f"{name:12s} {'back to back' if not gap else f'{gap} ms gaps':12s}: {us:7.1f} us a call; "
                  f"SM clock median {statistics.median(clock):.0f} MHz (min {min(clock):.0f}), "
                  f"power median {statistics.median(power):.0f} W (max {max(power):.0f})")
        del step


if __name__ == "__main__":
    main()
