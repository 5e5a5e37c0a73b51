"""Compile the kernels for an H100 (sm_90) on a machine without a GPU.

The interpreter runs the kernels' logic but never lowers them, so type errors in loops,
unsupported conversions (e.g. fp8 -> bf16) or shared-memory overflow would first show on the
GPU. Here each launcher runs with its `_x_kernel` swapped for a recorder that compiles the exact
launch (same constexprs, warps and stages; ints equal to 1 and 16-aligned values specialised
as Triton's JIT does, except those the kernel marks `do_not_specialize`) through Triton's NVIDIA
backend and bundled ptxas. That needs kernels built without the interpreter, so the compiling
runs in one subprocess (this file as a script) with TRITON_INTERPRET unset; the tests read its
report.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

if __name__ != "__main__":
    pytest.importorskip("triton")
import triton  # noqa: E402

H100_SMEM = 232448  # bytes of dynamic shared memory one block may use on sm_90
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
          torch.float8_e5m2: "fp8e5"}


class _Recorder:
    def __init__(self, fn):
        self.fn, self.compiled, self.mixed = fn, [], []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages")
                       if k in constexprs}
            self.mixed.append(bool(constexprs.get("MIXED")))
            constexprs.pop("launch_pdl", None)  # a launch attribute, not part of the compile
            if "PDL" in constexprs:  # compile the grid-dependency instructions an H100 runs
                constexprs["PDL"] = True
            signature, attrs = {}, {}
            constexprs = dict(constexprs)
            plain = {p.name for p in self.fn.params if p.do_not_specialize}  # as the JIT leaves them
            for i, (name, a) in enumerate(zip(self.fn.arg_names, args)):
                if isinstance(a, torch.Tensor):
                    signature[name] = "*" + _TYPES[a.dtype]
                    attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(a, int) and name in plain:
                    signature[name] = "i64" if abs(a) >= 2 ** 31 else "i32"
                elif isinstance(a, int) and a == 1:
                    signature[name], constexprs[name] = "constexpr", 1
                elif isinstance(a, int):
                    signature[name] = "i64" if abs(a) >= 2 ** 31 else "i32"
                    if a % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    signature[name] = "fp32"
            for name in constexprs:
                signature[name] = "constexpr"
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            kernel = triton.compile(ASTSource(self.fn, signature, constexprs, attrs),
                                    target=GPUTarget("cuda", 90, 32), options=options)
            self.compiled.append(kernel)
        return launch


def _install_recorders():
    from triton.backends.compiler import GPUTarget  # noqa: F401 - fail early if missing
    found = {}
    for module, name in [("paged_attention", "_paged_attention_kernel"),
                         ("split_kv", "_reduce_splits_kernel"),
                         ("store_kv", "_store_kv_kernel")]:
        mod = sys.modules[f"pagedattn.kernels.{module}"]
        fn = getattr(mod, name)
        found[name] = _Recorder(fn.fn if isinstance(fn, _Recorder) else fn)
        setattr(mod, name, found[name])
    return found


# (context_len, query_len) per sequence
CASES = {
    "decode_bf16_d128_split": dict(lens=[(39, 1), (8, 1)], heads=(32, 8), head_size=128,
                                   dtype=torch.bfloat16, splits=2),
    "decode_bf16_d128_37_splits": dict(lens=[(900, 1)], heads=(8, 1), head_size=128,  # merged 16 at a time
                                       dtype=torch.bfloat16, splits=37),
    "prefill_bf16_d128": dict(lens=[(40, 200)], heads=(32, 8), head_size=128,
                              dtype=torch.bfloat16),
    "prefill_fp16_d80_fp8e5_options": dict(lens=[(10, 90), (6, 1)], heads=(8, 2),
                                           head_size=80, dtype=torch.float16,
                                           kv_cache_dtype="fp8_e5m2", block_size=5,
                                           sliding_window=4, soft_cap=3.0, alibi=True),
    "prefill_bf16_d256_fp8e4": dict(lens=[(40, 200)], heads=(8, 2), head_size=256,
                                    dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3"),
    # long prompts over pages: the 128-key prefill tiles
    "long_prefill_bf16_d128_fp8e4": dict(lens=[(4000, 130)], heads=(32, 8), head_size=128,
                                         dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3"),
    "long_prefill_fp16_d64": dict(lens=[(4000, 130)], heads=(8, 2), head_size=64, dtype=torch.float16),
    # mixed launches (`decodes`: the last sequences are decodes with a tile of their own)
    "mixed_bf16_d128": dict(lens=[(64, 200)] + [(40, 1)] * 3, heads=(32, 8), head_size=128,
                            dtype=torch.bfloat16, decodes=3),
    "mixed_long_bf16_d128_split": dict(lens=[(4000, 130)] + [(900, 1)] * 2, heads=(32, 8), head_size=128,
                                       dtype=torch.bfloat16, decodes=2, splits=2),
    "mixed_fp16_d80_fp8e5_options": dict(lens=[(10, 90), (0, 1), (6, 1)], heads=(8, 2),
                                         head_size=80, dtype=torch.float16,
                                         kv_cache_dtype="fp8_e5m2", block_size=5,
                                         sliding_window=4, soft_cap=3.0, alibi=True, decodes=2),
    "mixed_bf16_d256_fp8e4": dict(lens=[(40, 200), (30, 1)], heads=(8, 2), head_size=256,
                                  dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3", decodes=1),
    "mixed_bf16_d64_gqa1": dict(lens=[(40, 200), (30, 1), (9, 1)], heads=(8, 8), head_size=64,
                                dtype=torch.bfloat16, decodes=2),
}


def _compile_case(case: str) -> dict:
    import pagedattn.kernels as K
    from paged_kernel import attend, kernel_args, kernel_batch

    recorders = _install_recorders()
    if case.startswith("store_kv_"):
        cache_dtype = getattr(torch, case[len("store_kv_"):])
        key = torch.randn(9, 8, 80)
        cache = torch.zeros(10, 5, 8, 80, dtype=cache_dtype)
        K.store_kv(key, key, cache, cache, torch.arange(9), torch.tensor(1.0),
                   torch.tensor(1.0))
    else:
        c = CASES[case]
        num_heads, num_kv_heads = c["heads"]
        batch = kernel_batch(c["lens"], num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=c["head_size"], block_size=c.get("block_size", 16),
                             dtype=c["dtype"], kv_cache_dtype=c.get("kv_cache_dtype", "auto"),
                             device="cpu")
        ws = K.SplitKVWorkspace.allocate(batch.num_tokens, num_heads, c["head_size"],
                                         max(4, c.get("splits", 1)), "cpu")
        attend(kernel_args(batch), scale=0.1, workspace=ws, num_splits=c.get("splits"),
               sliding_window=c.get("sliding_window"), soft_cap=c.get("soft_cap"),
               alibi_slopes=torch.ones(num_heads) if c.get("alibi") else None,
               num_decodes=c.get("decodes", 0))
    out = {name: [k.metadata.shared for k in rec.compiled] for name, rec in recorders.items()}
    return out | {"mixed": recorders["_paged_attention_kernel"].mixed}


STORE_CASES = ["store_kv_float8_e4m3fn", "store_kv_float8_e5m2"]


@pytest.fixture(scope="module")
def report():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests compile and run the real kernels")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    # the script imports what pytest's pythonpath gives the tests, and its own folder's helper
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(tests), tests, here,
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES) + STORE_CASES)
def test_compiles_for_sm90(case, report):
    result = report[case]
    assert isinstance(result, dict), result  # else: the compiler's error message
    if case in STORE_CASES:
        assert len(result["_store_kv_kernel"]) == 1
        return
    shared = result["_paged_attention_kernel"]
    assert len(shared) == 1 and shared[0] <= H100_SMEM
    assert result["mixed"] == [bool(CASES[case].get("decodes"))]  # decodes got their own tile
    if CASES[case].get("splits"):
        assert len(result["_reduce_splits_kernel"]) == 1


if __name__ == "__main__":
    results = {}
    for name in list(CASES) + STORE_CASES:
        try:
            results[name] = _compile_case(name)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = f"{type(exc).__name__}: {exc}"[-3000:]
    print(json.dumps(results))
