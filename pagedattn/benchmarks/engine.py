"""Engine throughput and latency at real model shapes: our engine against transformers'
continuous batching (`generate_batch`) on the same weights.

Models: SmolLM2-135M, Llama-3-8B, Llama-3-70B and Qwen2-7B shapes with seeded random weights
made on the device (`pagedattn.models.dummy`; nothing is downloaded; `--num-layers` keeps a
shape's first layers, the report says so), bf16 on CUDA (CUDA graphs on), float32 on the CPU.
Prompts are random token ids; decoding is greedy with EOS ignored. `--tensor-parallel-size N`
shards the model over N GPUs (transformers, one GPU's, is then not run).

Per shape, in one process:
1. offline: for each workload (`128/128`, `1024/128`, `128/1024` input/output tokens, and
   `sharegpt`, log-normal lengths, see `engine_offline.SHAREGPT`) and batch, `batch` requests
   are queued at once and run to the end: a warm-up run, then `--reps` timed runs; the median
   output tokens/s and the spread (max - min) / median of the run times. transformers runs the
   fixed workloads on the same weight tensors (its generate_batch takes one max_new_tokens, so
   not `sharegpt`), after our engine is freed, so each side has the device's memory.
2. the decode step: every engine step of 64 requests (128-token prompts) once all are in
   decode, timed; its median against the floor (weights + K/V read once at the device-to-device
   copy bandwidth measured at the start of the run); with async scheduling on (CUDA), again
   with it off, which shows the host's share of a step.
   With `--shared-prefix N`: 64 requests over one cached prefix of N tokens (128 tokens of
   their own, 128 output tokens), their decode step with cascade attention, without it (graphs)
   and without it eagerly, and token equality (`engine_shared_prefix`); it turns cascade
   attention on, on the CPU too (off there by default).
3. online: `pagedattn serve`'s app on loopback under a Poisson request rate (sharegpt lengths),
   TTFT / TPOT / ITL p50 and p99 (`engine_online`); skipped, with the reason, without fastapi.
With `--hf-attention` only transformers runs: `generate_batch` on pagedattn's attention
(`pagedattn.integrations.transformers`, the `--backend`) against its own `sdpa` paged default
and `paged|eager`, the same weights, each fixed workload: output tokens/s per implementation
(the `backend` column) and ours over sdpa as `speedup`. Where the installed transformers runs
no registered attention in generate_batch (5.19 on), that row is skipped with the reason.
Targets (Llama-3-8B on an H100): decode step within 1.3x of its floor, >= 5x transformers,
spread under 5%; printed next to the measurements. Results: JSON, CSV and a PNG in `--out`.

    pagedattn bench engine --quick                  # every shape, one workload: minutes
    pagedattn bench engine --model-shape llama3-8b  # every workload and batch
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
import traceback

import torch

SHAPES_CUDA = ("llama3-8b", "qwen2-7b", "smollm2-135m")  # the targets' shape first
DECODE_BATCH, DECODE_PROMPT = 64, 128
SHARED_PREFIX_OWN = 128  # --shared-prefix: each request's own prompt tokens, and its output tokens
# Batches per workload of a full run, sized so one shape fits a few minutes of an H100: the short
# workload across batch sizes (the plot), the long ones where the engine is meant to run.
FULL_PLAN = {"cuda": {"128/128": [1, 16, 64, 256], "1024/128": [16, 64], "128/1024": [64], "sharegpt": [256]},
             "cpu": {"128/128": [1, 16], "1024/128": [4], "128/1024": [1], "sharegpt": [16]}}
QUICK_PLAN = {"cuda": {"128/128": [64]}, "cpu": {"128/128": [4]}}


def _parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("\n", " "),
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default=None,
                   help="comma list of shapes (smollm2-135m, llama3-8b, llama3-70b, qwen2-7b, tiny-llama) or 'all' "
                        "(default: llama3-8b, qwen2-7b and smollm2-135m on CUDA, smollm2-135m on the CPU)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="keep each shape's first N layers (a model that would not fit; reported as such)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over this many GPUs (rank r on cuda:r); transformers is then not run")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU's memory for weights, activations and KV cache (default 0.9)")
    p.add_argument("--backend", default="auto", help="attention backend of our engine (default: auto)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--quick", action="store_true",
                   help="one workload (128/128) at one batch (64 on CUDA, 4 on the CPU), short decode and online parts")
    p.add_argument("--out", default="engine-bench", help="folder for the JSON, CSV and PNG (default: ./engine-bench)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per cell, after a warm-up (default 3)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' generate_batch")
    p.add_argument("--no-online", action="store_true", help="skip the online latency part")
    p.add_argument("--hf-attention", action="store_true",
                   help="only transformers' generate_batch: pagedattn's attention (--backend) against its sdpa and "
                        "paged|eager attention, same weights (fixed workloads)")
    p.add_argument("--workloads", default=None,
                   help="comma list of 128/128, 1024/128, 128/1024, sharegpt (default: all; --quick: 128/128)")
    p.add_argument("--batches", default=None,
                   help="comma list of batch sizes for every workload (default per workload, CUDA / CPU: "
                        + "; ".join(f"{w} {','.join(map(str, b))} / {','.join(map(str, FULL_PLAN['cpu'][w]))}"
                                    for w, b in FULL_PLAN["cuda"].items()) + ")")
    p.add_argument("--max-model-len", type=int, default=4096, help="context of every shape (default 4096)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="online requests per second (default: 8 on CUDA, 1 on the CPU, 2 with --quick)")
    p.add_argument("--online-requests", type=int, default=None,
                   help="online requests sent (default: 200 on CUDA, 48 with --quick; 16 on the CPU, 8 with --quick)")
    p.add_argument("--max-cell-s", type=float, default=90.0,
                   help="time for a cell's timed runs: fewer repetitions when the warm-up says they would "
                        "take longer, none when the warm-up alone did (default 90)")
    p.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="also decode 64 requests over one cached prefix of N tokens with cascade attention and "
                        "without (needs --max-model-len >= N + 256)")
    p.add_argument("--no-cascade-attention", dest="cascade_attention", action="store_const", const=False,
                   default=None, help="our engine attends each request's whole context in every step")
    p.add_argument("--seed", type=int, default=0)
    return p


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The run's plan from the flags and the device, or parser.error (one line, exit 2)."""
    from pagedattn.benchmarks.engine_offline import WORKLOADS
    from pagedattn.engine.config import EngineConfig
    from pagedattn.models.dummy import SHAPES

    try:
        device = EngineConfig(device=args.device).resolved_device()
    except ValueError as e:
        parser.error(str(e))
    cuda = device.type == "cuda"
    shapes = args.model_shape or ("all" if cuda else "smollm2-135m")
    shapes = list(SHAPES_CUDA) if shapes == "all" else shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        parser.error(f"expected --model-shape in {sorted(SHAPES)} or 'all', got {','.join(bad)}")
    defaults = (QUICK_PLAN if args.quick else FULL_PLAN)[device.type]
    workloads = args.workloads.split(",") if args.workloads else list(defaults)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"expected --workloads in {list(WORKLOADS)}, got {','.join(bad)}")
    try:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    except ValueError:
        parser.error(f"expected --batches to be a comma list of ints, got {args.batches!r}")
    plan = [(w, b) for w in workloads for b in sorted(set(batches or defaults.get(w) or FULL_PLAN[device.type][w]))]
    if min(b for _, b in plan) < 1 or args.reps < 1 or args.max_model_len < 256:
        parser.error(f"expected batches >= 1, --reps >= 1, --max-model-len >= 256; got {batches}, "
                     f"{args.reps}, {args.max_model_len}")
    from pagedattn.attention.registry import BackendUnavailableError, get_backend

    try:  # "auto" as LLMEngine resolves it (torch on the CPU), since the model is built with the backend
        backend = get_backend("torch" if args.backend == "auto" and not cuda else args.backend).get_name()
    except BackendUnavailableError as e:
        parser.error(str(e))
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    rate = args.request_rate or (8.0 if cuda else (2.0 if args.quick else 1.0))
    online = args.online_requests or ((48 if args.quick else 200) if cuda else (8 if args.quick else 16))
    if rate <= 0 or online < 1:
        parser.error(f"expected --request-rate > 0 and --online-requests >= 1, got {rate}, {online}")
    try:
        EngineConfig(device=args.device, tensor_parallel_size=args.tensor_parallel_size,
                     gpu_memory_utilization=args.gpu_memory_utilization)
    except ValueError as e:
        parser.error(str(e).replace("tensor_parallel_size", "--tensor-parallel-size")
                     .replace("gpu_memory_utilization", "--gpu-memory-utilization"))
    if args.num_layers is not None and args.num_layers < 1:
        parser.error(f"expected --num-layers >= 1, got {args.num_layers}")
    if args.shared_prefix is not None:
        if args.shared_prefix < 1 or args.shared_prefix + 2 * SHARED_PREFIX_OWN > args.max_model_len:
            parser.error(f"expected 1 <= --shared-prefix <= --max-model-len - {2 * SHARED_PREFIX_OWN} "
                         f"({args.max_model_len - 2 * SHARED_PREFIX_OWN}), got {args.shared_prefix}")
        if args.cascade_attention is False:
            parser.error("expected --shared-prefix without --no-cascade-attention (it compares both)")
    return dict(device=device, shapes=shapes, plan=plan, dtype=dtype,
                backend=backend, reps=args.reps, max_model_len=args.max_model_len, seed=args.seed,
                transformers=not args.no_transformers and args.tensor_parallel_size == 1,
                tensor_parallel_size=args.tensor_parallel_size, num_layers=args.num_layers,
                gpu_memory_utilization=args.gpu_memory_utilization, online=not args.no_online, request_rate=rate,
                online_requests=online,
                online_max_tokens=(128 if args.quick else 512) if cuda else (32 if args.quick else 128),
                decode_steps=(64 if args.quick else 128) if cuda else (8 if args.quick else 32),
                max_cell_s=args.max_cell_s,
                max_num_seqs=max(*(b for _, b in plan), DECODE_BATCH), quick=args.quick,
                hf_attention=args.hf_attention, shared_prefix=args.shared_prefix,
                # --shared-prefix compares the engine with and without: it needs it on (the CPU's too)
                cascade_attention=True if args.shared_prefix is not None else args.cascade_attention)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    settings = _settings(args, parser)
    from tqdm.auto import tqdm

    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.benchmarks import engine_report as report

    device = settings["device"]
    result = {"environment": report.environment(device),
              "settings": {k: str(v) if isinstance(v, (torch.device, torch.dtype)) else v for k, v in settings.items()},
              "sharegpt": dataclasses.asdict(offline.SHAREGPT),
              "shapes": {}, "offline": []}
    bandwidth = offline.copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    result["copy_bandwidth_gb_s"] = bandwidth / 1e9
    plan = settings["plan"]
    fixed = sum(w in offline.FIXED for w, _ in plan)
    runs_per_shape = (len(plan) + fixed * settings["transformers"]) * (settings["reps"] + 1) + 2  # + decode, online
    runs_per_shape += settings["shared_prefix"] is not None
    if settings["hf_attention"]:
        runs_per_shape = fixed * len(HF_ATTENTION) * (settings["reps"] + 1)
    total = runs_per_shape * len(settings["shapes"])
    with tqdm(total=total, desc="engine bench", unit="run", dynamic_ncols=True) as bar:
        for shape in settings["shapes"]:
            try:
                bench = _bench_hf_attention if settings["hf_attention"] else _bench_shape
                result["shapes"][shape] = bench(shape, settings, bandwidth, result["offline"], bar)
            except Exception as e:  # noqa: BLE001 - keep the other shapes' results (device time is scarce)
                traceback.print_exc()
                result["shapes"][shape] = {"error": f"{type(e).__name__}: {e}", "skipped": []}
            _free(device)
            # written after each shape: a run cut short keeps what it measured
            result["environment"]["load_average_after"] = report.load_average()
            result["targets"] = report.targets(result)
            paths = report.write(result, args.out)
    report.print_summary(result)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 1 if any("error" in v for v in result["shapes"].values()) else 0


def _bench_shape(shape: str, s: dict, bandwidth: float, rows: list[dict], bar) -> dict:
    """Every part of the run for one model shape; offline rows are appended to `rows`."""
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.benchmarks import engine_online as online
    from pagedattn.benchmarks.engine_report import decode_step_line
    from pagedattn.benchmarks.transformers_runner import TransformersRunner
    from pagedattn.engine.config import EngineConfig
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.models.dummy import SHAPES, load_dummy_model, transformers_model

    device, backend, size = s["device"], s["backend"], s["tensor_parallel_size"]
    bar.set_description(f"{shape}: building")
    make = functools.partial(load_dummy_model, shape, dtype=s["dtype"], attention_backend=backend,
                             max_model_len=min(s["max_model_len"], _context(shape)), seed=s["seed"],
                             num_layers=s["num_layers"])
    config = EngineConfig(device=str(device), backend=backend, max_num_seqs=s["max_num_seqs"], seed=s["seed"],
                          tensor_parallel_size=size, gpu_memory_utilization=s["gpu_memory_utilization"],
                          cascade_attention=s["cascade_attention"])
    info = {"backend": backend, "dtype": str(s["dtype"]).removeprefix("torch."), "tensor_parallel_size": size,
            "num_layers": s["num_layers"] or SHAPES[shape]["num_hidden_layers"],
            "all_layers": s["num_layers"] in (None, SHAPES[shape]["num_hidden_layers"]), "skipped": []}
    peer = None
    if size == 1:
        loaded = make(device=device)
        # what one rank reads: counted before the engine, which repacks CPU linears
        info.update(parameters=sum(p.numel() for p in loaded.model.parameters()),
                    weight_bytes_read=offline.weight_bytes_read(loaded.model))
        if s["transformers"]:
            peer = transformers_model(loaded)  # before the engine: on the CPU it repacks our linears
            why = TransformersRunner.unavailable_reason(peer)
            if why:
                info["skipped"].append(f"transformers: {why}")
                peer = None
        engine = LLMEngine(config, loaded)
    else:
        loaded = None
        engine = LLMEngine(config, make)  # every rank makes its shard of the same weights
        info.update(parameters_per_rank=sum(p.numel() for p in engine.runner.model.parameters()),
                    weight_bytes_read=offline.weight_bytes_read(engine.runner.model))
        info["skipped"].append(f"transformers: runs on one GPU, not compared at --tensor-parallel-size {size}")
    spec = engine.spec
    info["max_model_len"] = spec.max_model_len
    info["num_kv_blocks"] = engine.block_manager.num_blocks
    ours = {}
    for workload, batch in s["plan"]:
        lengths = offline.request_lengths(workload, batch, max_model_len=spec.max_model_len, seed=s["seed"])
        bar.set_description(f"{shape}: pagedattn {workload} x{batch}")
        cell = offline.measure(
            lambda rep: offline.run_ours(engine, offline.make_requests(
                lengths, vocab_size=spec.vocab_size, seed=s["seed"], rep=rep)),
            s["reps"], s["max_cell_s"], bar.update)
        ours[workload, batch] = _row(rows, shape, "pagedattn", backend, s, workload, batch, lengths, cell)
    bar.set_description(f"{shape}: decode step")
    step = dict(batch=DECODE_BATCH, prompt_len=DECODE_PROMPT, steps=s["decode_steps"], seed=s["seed"],
                weight_bytes=info["weight_bytes_read"], bandwidth=bandwidth)
    info["decode_step"] = offline.decode_step(engine, **step)
    all_reduce = engine.runner.time_all_reduce(DECODE_BATCH)
    if all_reduce is not None:
        info["decode_step"].update(all_reduce_s=all_reduce, all_reduces_per_step=2 * spec.num_layers,
                                   all_reduce_step_s=2 * spec.num_layers * all_reduce,
                                   all_reduce=engine.parallel.tp.all_reduce_name)
    if engine.async_scheduling:  # the same steps, each read before the next is queued: what async hides
        engine.async_scheduling = False
        info["decode_step_sync"] = offline.decode_step(engine, **step)
        engine.async_scheduling = True
    bar.write(decode_step_line(shape, info))  # now: a run cut later (a hung shutdown, a time limit) keeps it
    bar.update()
    if s["shared_prefix"] is not None:
        from pagedattn.benchmarks.engine_shared_prefix import run_shared_prefix

        bar.set_description(f"{shape}: shared prefix")
        info["shared_prefix"] = run_shared_prefix(engine, prefix_len=s["shared_prefix"], suffix_len=SHARED_PREFIX_OWN,
                                                  output_len=SHARED_PREFIX_OWN, batch=DECODE_BATCH, seed=s["seed"])
        bar.update()
    if s["online"]:
        why = online.unavailable_reason()
        if why:
            info["skipped"].append(why)
        else:
            bar.set_description(f"{shape}: online")
            lengths = offline.request_lengths("sharegpt", s["online_requests"], max_model_len=spec.max_model_len,
                                              seed=s["seed"] + 1)
            lengths = [(i, min(o, s["online_max_tokens"])) for i, o in lengths]
            requests = offline.make_requests(lengths, vocab_size=spec.vocab_size, seed=s["seed"], rep=-3)
            info["online"] = online.run_online(engine, shape, requests, rate=s["request_rate"], seed=s["seed"])
    bar.update()
    engine.shutdown()
    del engine
    _free(device)
    if peer is not None:
        if device.type == "cuda":  # what our engine left behind (the shared weights, no more)
            info["allocated_gib_before_transformers"] = torch.cuda.memory_allocated(device) / 2**30
        runner = TransformersRunner(peer)
        info["transformers"] = runner.description
        for workload, batch in ((w, b) for w, b in s["plan"] if w in offline.FIXED):
            lengths = offline.request_lengths(workload, batch, max_model_len=spec.max_model_len, seed=s["seed"])
            bar.set_description(f"{shape}: transformers {workload} x{batch}")
            try:
                cell = offline.measure(
                    lambda rep: runner.run(offline.make_requests(
                        lengths, vocab_size=spec.vocab_size, seed=s["seed"], rep=rep)),
                    s["reps"], s["max_cell_s"], bar.update)
            except Exception as e:  # noqa: BLE001 - the peer's API moves between versions: report, go on
                info["skipped"].append(f"transformers {workload} x{batch}: {type(e).__name__}: {e}")
                continue
            finally:
                runner.close()
            row = _row(rows, shape, "transformers", "generate_batch", s, workload, batch, lengths, cell)
            ours[workload, batch]["speedup"] = ours[workload, batch]["tokens_per_s"] / row["tokens_per_s"]
        del runner
    del peer, loaded
    _free(device)
    return info


HF_ATTENTION = ("pagedattn", "sdpa", "paged|eager")
"""--hf-attention's implementations: ours (the name `register` returns), then transformers' own."""


def _bench_hf_attention(shape: str, s: dict, bandwidth: float, rows: list[dict], bar) -> dict:
    """transformers' generate_batch on one model, its attention switched between ours and its own;
    rows are appended to `rows` (impl "transformers", backend the attention implementation)."""
    from pagedattn.benchmarks import engine_offline as offline
    from pagedattn.benchmarks.transformers_runner import TransformersRunner
    from pagedattn.integrations import transformers as pa_hf
    from pagedattn.models.dummy import load_dummy_model, transformers_model

    device = s["device"]
    bar.set_description(f"{shape}: building")
    loaded = load_dummy_model(shape, device=device, dtype=s["dtype"], attention_backend=s["backend"],
                              max_model_len=min(s["max_model_len"], _context(shape)), seed=s["seed"])
    peer = transformers_model(loaded)
    del loaded  # its engine-side model: the peer's parameters are views that keep the weights
    info = {"backend": s["backend"], "dtype": str(s["dtype"]).removeprefix("torch."), "skipped": []}
    why = TransformersRunner.unavailable_reason(peer)
    if why:
        info["skipped"].append(f"transformers: {why}")
        return info
    # transformers 5.1-5.18 switch "sdpa" to "paged|sdpa" inside generate_batch, later ones run "sdpa" itself
    names = {"pagedattn": pa_hf.register(s["backend"]), "sdpa": "sdpa", "paged|eager": "paged|eager"}
    ours_why = pa_hf.generate_batch_unavailable_reason()
    fixed = [(w, b) for w, b in s["plan"] if w in offline.FIXED]
    vocab = peer.config.vocab_size
    per_cell: dict[tuple, dict] = {}
    for key in HF_ATTENTION:
        impl = names[key]
        if key == "pagedattn" and ours_why:
            info["skipped"].append(f"transformers generate_batch on {impl}: {ours_why}")
            for _ in range(len(fixed) * (s["reps"] + 1)):
                bar.update()
            continue
        try:
            peer.set_attn_implementation(impl)
        except (ValueError, ImportError) as e:  # e.g. Gemma 2 has no sdpa
            info["skipped"].append(f"transformers {impl}: {e}")
            for _ in range(len(fixed) * (s["reps"] + 1)):
                bar.update()
            continue
        runner = TransformersRunner(peer)
        for workload, batch in fixed:
            lengths = offline.request_lengths(workload, batch, max_model_len=_context(shape), seed=s["seed"])
            bar.set_description(f"{shape}: transformers {impl} {workload} x{batch}")
            try:
                cell = offline.measure(lambda rep: runner.run(offline.make_requests(
                    lengths, vocab_size=vocab, seed=s["seed"], rep=rep)), s["reps"],
                    s["max_cell_s"], bar.update)
            except Exception as e:  # noqa: BLE001 - the peer's API moves between versions: report, go on
                info["skipped"].append(f"transformers {impl} {workload} x{batch}: {type(e).__name__}: {e}")
                continue
            finally:
                runner.close()
            per_cell.setdefault((workload, batch), {})[key] = _row(rows, shape, "transformers", impl, s, workload,
                                                                  batch, lengths, cell)
    for cell in per_cell.values():
        if "pagedattn" in cell and "sdpa" in cell:
            cell["pagedattn"]["speedup"] = cell["pagedattn"]["tokens_per_s"] / cell["sdpa"]["tokens_per_s"]
    del peer
    _free(device)
    return info


def _row(rows: list[dict], shape, impl, backend, s, workload, batch, lengths, cell) -> dict:
    row = {"shape": shape, "impl": impl, "backend": backend, "device": str(s["device"]),
           "dtype": str(s["dtype"]).removeprefix("torch."), "workload": workload, "batch": batch,
           "mean_input_len": statistics.mean(i for i, _ in lengths),
           "mean_output_len": statistics.mean(o for _, o in lengths), "reps": len(cell["runs_s"]),
           "generated_tokens": cell["generated"], "median_s": cell["median_s"], "tokens_per_s": cell["tokens_per_s"],
           "spread": cell["spread"], "runs_s": cell["runs_s"], "speedup": None, "note": cell["note"]}
    rows.append(row)
    return row


def _context(shape: str) -> int:
    from pagedattn.models.dummy import SHAPES

    return SHAPES[shape]["max_position_embeddings"]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
