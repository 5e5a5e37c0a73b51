"""Compile the engine's attention launches for each GPU generation, on a machine without a GPU.

Tiles follow a `DeviceProfile` (shared memory a program may hold, SMs, capability) and the
interpreter never lowers a kernel, so a tile over an A10's 99 KiB or an FP8 conversion an A100
lacks would first show on that GPU. Per target (sm_80 A100, sm_86 A10, sm_89 L40S, sm_90 H100;
sm_100, sm_120 where this Triton compiles them) the CASES run `paged_attention(..., profile=)`
with the attention, `reduce_splits` and `store_kv` kernels swapped for a recorder that compiles
each launch exactly (its constexprs, warps and stages; ints equal to 1 and 16-aligned values
specialised as the JIT does, but not `do_not_specialize` ones) by `triton.compile(ASTSource(...),
target=GPUTarget("cuda", cc, 32))` with the bundled ptxas. The tests check that each compiles,
that `metadata.shared` fits the profile's `smem_per_block`, and that FP8 e4m3 compiles exactly
where `profile.fp8_e4m3` says. That needs kernels built without the interpreter: one subprocess
per target (this file as a script, TRITON_INTERPRET unset) prints a JSON report the tests read.
"""

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

if __name__ != "__main__":
    pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

try:  # compiling for a target that is not here (older Tritons lack it: the tests skip)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    GPUTarget = ASTSource = None
from pagedattn.device_profile import PRESETS  # noqa: E402
from pagedattn.kernels.paged_attention_config import DECODE_ROWS  # noqa: E402

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
          torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# target -> the profile whose plans it compiles. sm_100/sm_120 have no preset: a B200 (227 KiB a
# block, as the H100) and an RTX 5090 (99 KiB, as the other consumer parts).
PROFILES = {80: PRESETS["a100"], 86: PRESETS["a10"], 89: PRESETS["l40s"], 90: PRESETS["h100"],
            100: PRESETS["h100"].with_(name="b200", capability=(10, 0), num_sms=148),
            120: PRESETS["rtx4090"].with_(name="rtx5090", capability=(12, 0), num_sms=170)}
KERNELS = {"paged_attention": "_paged_attention_kernel", "split_kv": "_reduce_splits_kernel",
           "store_kv": "_store_kv_kernel"}
_PLAN_KEYS = ("BLOCK_M", "BLOCK_N", "MIXED", "DEC_BLOCK_M", "DEC_BLOCK_N", "DEC_STAGES", "SPLIT",  # reported
              "STORE_NEW", "SPLITS_BLOCK", "PDL", "num_warps", "num_stages")

# (context_len, query_len) per sequence; heads (32, 8), bf16, 16-key pages unless a case says.
# Every cache launch hands the step's rows over as the engine does (`write`): decodes write them
# in the attention kernel, prefills and mixed steps run `store_kv` first. Each case compiles for
# `targets`, so that the file runs in about 4 minutes on 2 cores: Blackwell (sm_100 compiles ~2x
# slower than sm_90) gets head size 128's decode, prefill and mixed tiles and an FP8 e4m3 decode.
ALL, CORE = tuple(PROFILES), (80, 86, 89, 90)
NO_E4M3 = tuple(t for t in CORE if not PROFILES[t].fp8_e4m3)
CASES = {}
for _d in (64, 128, 256):
    _t = ALL if _d == 128 else CORE
    CASES |= {
        f"decode_long_d{_d}": dict(lens=[(8000, 1)], head_size=_d, split=True, targets=_t),  # B=1: split-KV
        f"decode_b64_d{_d}": dict(lens=[(200, 1)] * 64, head_size=_d, targets=_t),  # short contexts
        f"prefill_d{_d}": dict(lens=[(40, 200)], head_size=_d, targets=_t),  # one chunk over a prefix
        f"mixed_d{_d}": dict(lens=[(64, 200)] + [(40, 1)] * 3, head_size=_d, decodes=3, targets=_t),
    }
    if _d != 256:  # from 4096 keys the 128-key tile (head size 256 has none)
        CASES[f"prefill_long_d{_d}"] = dict(lens=[(4000, 130)], head_size=_d, targets=CORE)
# e4m3 everywhere (it must fail to compile where the profile says it is missing); e5m2 where it
# is the only FP8 cache (the options case compiles e5m2 on every core target)
for _kv, _t in (("fp8_e4m3", ALL), ("fp8_e5m2", NO_E4M3)):
    CASES[f"decode_long_d128_{_kv}"] = dict(lens=[(8000, 1)], head_size=128, kv=_kv, split=True, targets=_t)
    CASES[f"mixed_d128_{_kv}"] = dict(lens=[(64, 200)] + [(40, 1)] * 3, head_size=128, kv=_kv, decodes=3,
                                      targets=tuple(t for t in _t if t in CORE))
_OPTIONS = dict(heads=(8, 2), head_size=80, dtype=torch.float16, kv="fp8_e5m2", block_size=5,
                sliding_window=4, soft_cap=3.0, alibi=True, targets=CORE)
CASES |= {
    "prompt_d128": dict(lens=[(0, 300)], head_size=128, prompt=True, targets=CORE),  # a fresh prompt
    # the former sm_90-only harness's (test_compile_sm90.py): the options in a mixed launch (both
    # bodies) on every core target, the rest on sm_90 as before (less its 37-split decode, the
    # reduction decode_long_d128 compiles, and its fp16 long prefill, prefill_long_d64's tile)
    "mixed_options_d80": dict(lens=[(10, 90), (0, 1), (6, 1)], decodes=2, **_OPTIONS),
    "prefill_options_d80": dict(lens=[(10, 90), (6, 1)], **(_OPTIONS | dict(targets=(90,)))),
    "decode_d128_2_splits": dict(lens=[(39, 1), (8, 1)], head_size=128, num_splits=2, split=True, targets=(90,)),
    "mixed_long_d128_2_splits": dict(lens=[(4000, 130)] + [(900, 1)] * 2, head_size=128, decodes=2,
                                     num_splits=2, split=True, targets=(90,)),
    "mixed_d64_gqa1": dict(lens=[(40, 200), (30, 1), (9, 1)], heads=(8, 8), head_size=64, decodes=2, targets=(90,)),
    "prefill_d256_fp8_e4m3": dict(lens=[(40, 200)], heads=(8, 2), head_size=256, kv="fp8_e4m3", targets=(90,)),
    "prefill_long_d128_fp8_e4m3": dict(lens=[(4000, 130)], head_size=128, kv="fp8_e4m3", targets=(90,)),
    "mixed_d256_fp8_e4m3": dict(lens=[(40, 200), (30, 1)], heads=(8, 2), head_size=256, kv="fp8_e4m3", decodes=1,
                                targets=(90,)),
    # attention sinks and the LSE: a split decode (the reduction adds the sink) and a mixed launch
    # (both bodies); a bidirectional two-sided window over contiguous rows (an encoder's)
    "decode_long_d128_sinks_lse": dict(lens=[(8000, 1)], head_size=128, split=True, sinks=True, lse=True,
                                       targets=CORE),
    "mixed_d128_sinks_lse": dict(lens=[(64, 200)] + [(40, 1)] * 3, head_size=128, decodes=3, sinks=True, lse=True,
                                 targets=(80, 90)),
    "encoder_two_sided_window_d64": dict(lens=[(0, 300)], head_size=64, encoder=True, sliding_window=(16, 8),
                                         targets=(80, 90)),
    # `store_kv` alone: float32 rows into FP8 pages of 5 keys
    **{f"store_kv_fp32_{kv}": dict(lens=[(0, 9)], heads=(8, 8), head_size=80, dtype=torch.float32, kv=kv,
                                    block_size=5, store_only=True, targets=CORE) for kv in ("fp8_e4m3", "fp8_e5m2")},
}


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


class _Recorder:
    """Stands in for a jitted kernel: compiles each launch for `target` and records the result."""

    def __init__(self, fn, name, target, pdl, launches):
        self.fn, self.name, self.target, self.pdl, self.launches = fn, name, target, pdl, launches

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
            constexprs.pop("launch_pdl", None)  # a launch attribute, not part of the compile
            if "PDL" in constexprs:  # what a GPU of the profile runs (the CPU's launchers say False)
                constexprs["PDL"] = self.pdl
            signature, attrs = {}, {}
            plain = {p.name for p in self.fn.params if p.do_not_specialize}  # as the JIT leaves them
            for i, (name, a) in enumerate(zip(self.fn.arg_names, args)):
                if isinstance(a, torch.Tensor):
                    signature[name] = "*" + _TYPES[a.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(a, int) and a == 1 and name not in plain:
                    signature[name], constexprs[name] = "constexpr", 1
                elif isinstance(a, int):
                    signature[name] = "i64" if abs(a) >= 2 ** 31 else "i32"
                    if a % 16 == 0 and name not in plain:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    signature[name] = "fp32"
            signature |= {name: "constexpr" for name in constexprs}
            entry = {"kernel": self.name, "plan": {k: v for k, v in (constexprs | options).items() if k in _PLAN_KEYS}}
            try:
                kernel = triton.compile(ASTSource(self.fn, signature, constexprs, attrs),
                                        target=GPUTarget("cuda", self.target, 32), options=options)
                entry["shared"] = kernel.metadata.shared
            except Exception as exc:  # noqa: BLE001 - the tests judge it
                entry["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
            self.launches.append(entry)
        return launch


def _launch(c: dict, profile) -> None:
    """One `paged_attention` call of case `c`, as the engine makes it, planned for `profile`."""
    from pagedattn.intmath import cdiv
    from pagedattn.kernels import KVWrite, SplitKVWorkspace, paged_attention, store_kv
    from pagedattn.kernels.split_kv import _MIN_ROWS, MAX_SPLITS, ROWS_PER_SM

    (hq, hkv), d, bs, lens = c.get("heads", (32, 8)), c["head_size"], c.get("block_size", 16), c["lens"]
    dtype = c.get("dtype", torch.bfloat16)
    kv_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(c.get("kv"), dtype)
    width = max(cdiv(ctx + q, bs) for ctx, q in lens)
    pool = torch.empty(2, len(lens) * width, bs, hkv, d, dtype=kv_dtype)  # (2, blocks, ...) as the engine's
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    starts = torch.tensor([0, *itertools.accumulate(q for _, q in lens)], dtype=torch.int32)
    seq_lens = torch.tensor([ctx + q for ctx, q in lens], dtype=torch.int32)
    num_tokens = int(starts[-1])
    query, out = torch.empty(2, num_tokens, hq, d, dtype=dtype)
    step_k, step_v = torch.empty(2, num_tokens, hkv, d, dtype=dtype)
    slots = torch.arange(num_tokens, dtype=torch.int64)
    if c.get("store_only"):
        return store_kv(step_k, step_v, pool[0], pool[1], slots)
    # the scratch `shared_workspace` allocates on a GPU of this profile (it bounds the split count)
    workspace = SplitKVWorkspace.allocate(cdiv(max(ROWS_PER_SM * profile.num_sms, _MIN_ROWS), MAX_SPLITS), hq, d,
                                          MAX_SPLITS, "cpu")
    common = dict(query_start_loc=starts, seq_lens=seq_lens, max_query_len=max(q for _, q in lens),
                  max_seq_len=int(seq_lens.max()), scale=0.1, sliding_window=c.get("sliding_window"),
                  soft_cap=c.get("soft_cap"), alibi_slopes=torch.ones(hq) if c.get("alibi") else None,
                  workspace=workspace, num_splits=c.get("num_splits"), num_decodes=c.get("decodes", 0),
                  sinks=torch.zeros(hq) if c.get("sinks") else None,
                  lse=torch.empty(num_tokens, hq) if c.get("lse") else None, profile=profile)
    if c.get("encoder"):  # bidirectional over the step's rows, nothing written
        return paged_attention(query, step_k, step_v, out, **(common | dict(block_tables=None, kv_start_loc=starts,
                                                                             causal=False)))
    if c.get("prompt"):  # keys: the step's rows (`kv_start_loc`), also written into pages
        common |= dict(block_tables=None, kv_start_loc=starts, write=KVWrite(step_k, step_v, pool[0], pool[1], slots))
        return paged_attention(query, step_k, step_v, out, **common)
    paged_attention(query, pool[0], pool[1], out, block_tables=tables,
                    write=KVWrite(step_k, step_v, pool[0], pool[1], slots), **common)


def _compile_target(target: int) -> dict:
    try:
        triton.compile(ASTSource(_probe, {"x_ptr": "*fp32"}, {}), target=GPUTarget("cuda", target, 32))
    except Exception as exc:  # noqa: BLE001 - e.g. a ptxas that predates the architecture
        return {"skip": f"this Triton does not compile for sm_{target}: {type(exc).__name__}: {exc}"[:500]}
    import pagedattn.kernels  # noqa: F401 - the launchers' modules
    from pagedattn.kernels.attention_plan import plan_attention
    from pagedattn.kernels.pdl import use_pdl_on

    profile, launches, results = PROFILES[target], [], {}
    for module, name in KERNELS.items():
        mod = sys.modules[f"pagedattn.kernels.{module}"]
        setattr(mod, name, _Recorder(getattr(mod, name), name, target, use_pdl_on(profile), launches))
    plan_attention.cache_clear()  # plans hold the kernels they bound
    for case, c in CASES.items():
        if target not in c["targets"]:
            continue
        launches.clear()
        try:
            _launch(c, profile)
            results[case] = {"launches": list(launches)}
        except Exception as exc:  # noqa: BLE001 - e.g. no tile fits: reported to the test
            results[case] = {"launches": list(launches), "error": f"{type(exc).__name__}: {exc}"[-1500:]}
    return results


def _run_target(target: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Triton 3.6 on sm_90 sends 16-bit prefills to the Gluon kernel (not compiled here); this
    # compiles the portable kernel an H100 runs for them otherwise (PAGEDATTN_GLUON=0, other Tritons).
    env["PAGEDATTN_GLUON"] = "0"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here)), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(target)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"crash": proc.stderr[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reports():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests compile and run the real kernels")
    if ASTSource is None:
        pytest.skip("this Triton has no ASTSource/GPUTarget to compile with")
    order = sorted(PROFILES, key=lambda t: t not in (90, 100))  # the longest first
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # LLVM and ptxas: one core each
        return dict(zip(order, pool.map(_run_target, order)))


def _describe(launch: dict) -> str:  # what a failure shows of a launch
    return f"{launch['kernel']} {launch['plan']}: " + launch.get("error", f"{launch.get('shared')} B")


@pytest.mark.parametrize("target,case", [(t, c) for t in PROFILES for c in CASES if t in CASES[c]["targets"]])
def test_compiles_and_fits(target, case, reports):
    report = reports[target]
    if "skip" in report:
        pytest.skip(report["skip"])
    assert "crash" not in report, report["crash"]
    c, profile, result = CASES[case], PROFILES[target], report[case]
    assert "error" not in result, result["error"]  # the launcher refused (e.g. no tile fits)
    launches = result["launches"]
    kernel = "_store_kv_kernel" if c.get("store_only") else "_paged_attention_kernel"
    main = [x for x in launches if x["kernel"] == kernel]
    assert len(main) == 1, launches
    if c.get("kv") == "fp8_e4m3" and not profile.fp8_e4m3:
        # the capability claim is true: e4m3 (`fp8e4nv`) does not compile on sm_80/86
        failed = [x for x in launches if "error" in x]
        assert "error" in main[0] and all("fp8e4nv" in x["error"] for x in failed), failed
        return
    failed = [_describe(x) for x in launches if "error" in x]
    assert not failed, f"{profile.name} (sm_{target}): " + "; ".join(failed)
    over = [_describe(x) for x in launches if x["shared"] > profile.smem_per_block]
    assert not over, f"{profile.name} holds {profile.smem_per_block} B a block: " + "; ".join(over)
    if c.get("store_only"):
        return
    # the variant meant: a mixed launch's decodes get a tile of their own where the prefill
    # tile has more rows than a decode tile (not where d256 shrank it to 64 rows); splits merge
    plan = main[0]["plan"]
    assert plan["MIXED"] == (bool(c.get("decodes")) and plan["BLOCK_M"] > DECODE_ROWS)
    reduced = [x for x in launches if x["kernel"] == "_reduce_splits_kernel"]
    assert len(reduced) == int(plan["SPLIT"]) >= int(bool(c.get("split"))), launches
    # decodes write their new rows in the attention kernel; other cache steps store them first
    stored = [x for x in launches if x["kernel"] == "_store_kv_kernel"]
    if c.get("encoder"):
        assert not plan["STORE_NEW"] and not stored, launches
        return
    decode_like = all(q == 1 for _, q in c["lens"])
    assert plan["STORE_NEW"] == decode_like and len(stored) == (0 if decode_like else 1)


if __name__ == "__main__":
    print(json.dumps(_compile_target(int(sys.argv[1]))))
