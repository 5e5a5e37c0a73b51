"""Where a decode step's device time goes: the engine's CUDA graph of `--batch` decodes at a real
model shape (random weights), replayed under torch.profiler; kernels grouped by name.

    python scripts/profile_decode.py [--shape llama3-8b] [--batch 64] [--backend triton]
"""

import argparse
from collections import defaultdict

import torch

from pagedattn.engine.config import EngineConfig
from pagedattn.engine.llm_engine import LLMEngine
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.models.dummy import load_dummy_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--backend", default="triton")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args()
    loaded = load_dummy_model(args.shape, device="cuda", dtype=torch.bfloat16, attention_backend=args.backend,
                              max_model_len=2048)
    engine = LLMEngine(EngineConfig(device="cuda", backend=args.backend, max_num_seqs=max(64, args.batch)), loaded)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(128)], params)
    for _ in range(8):  # prefills, then a few decode steps
        engine.step()
    graph = engine.runner.time_decode_graph(args.batch, reps=20)
    print(f"graph replay (median of 20): {graph * 1e6:.0f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            engine.runner.time_decode_graph(args.batch, reps=1)
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] += e.device_time_total / args.replays
            counts[e.name] += 1
    whole = sum(totals.values())
    print(f"kernel time per replay: {whole:.0f} us in {sum(counts.values()) // args.replays} kernels")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us:8.1f} us {100 * us / whole:5.1f}%  x{counts[name] // args.replays:4d}  "
              f"{us / max(1, counts[name] // args.replays):7.2f} us each  {name[:110]}")


if __name__ == "__main__":
    main()
