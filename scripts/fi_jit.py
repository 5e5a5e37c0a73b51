"""FlashInfer's kernels, compiled ahead of the test run on the GPU machine.

FlashInfer JIT-compiles one module per kernel variant (dtypes, head size, window, soft cap) on
first use, 30-120 s each, one at a time inside whichever test meets it first. A fresh GPU
machine would spend its whole call compiling. Instead:

1. `record`: run the suite with this file as a pytest plugin (`-p fi_jit`, FI_JIT_RECORD=path).
   Every module that is not built yet is written out as a ninja file and its path recorded; the
   test gets a stub module (its calls do nothing) so it goes on to meet its next module.
2. `build`: one ninja over all recorded modules, all cores busy (`-k 0`: a failed variant does
   not stop the rest); stops cleanly at `--seconds`.
3. `pack OUT`: the built `.so` files, each xz-compressed, in tar parts of at most 15 MiB, to
   bring back; `install DIR` puts them into FlashInfer's AOT directory (`<name>/<name>.so`) on
   the next machine, where they load without compiling.

    python scripts/fi_jit.py build --seconds 400
    python scripts/fi_jit.py pack "$OUT" --tag r1
    python scripts/fi_jit.py install .fi-aot
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

RECORD_ENV = "FI_JIT_RECORD"
PART_BYTES = 15 << 20


# ----------------------------------------------------------------------------- pytest plugin


class _Stub:
    """A module whose functions do nothing: `plan` returns a dummy plan, `workspace_size`
    (0, 0), anything else None. Outputs are garbage; the test goes on to its next module."""

    def __getattr__(self, name):
        if name == "plan":
            return lambda *args, **kwargs: [0] * 16
        if name == "workspace_size":
            return lambda *args, **kwargs: (0, 0)
        return lambda *args, **kwargs: None


def pytest_configure(config):
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    from flashinfer.jit.core import JitSpec

    original = JitSpec.build_and_load

    def build_and_load(self):
        if self.is_aot or self.jit_library_path.exists():
            return original(self)
        self.write_ninja()
        with open(path, "a") as f:
            f.write(f"{self.name}\t{self.ninja_path}\n")
        return _Stub()

    JitSpec.build_and_load = build_and_load


# ----------------------------------------------------------------------------- command line


def _jit_env():
    from flashinfer.jit import env

    return env


def build(record: Path, seconds: float, jobs: int, group: int = 6) -> int:
    """Compile the recorded modules, `group` at a time (one ninja each, all cores busy), so
    that modules finish one group after another: a build cut short at `seconds` still leaves
    whole modules (one ninja over all of them interleaves every module's objects, and none
    links until the end)."""
    env = _jit_env()
    seen: dict[str, str] = {}
    for line in record.read_text().splitlines() if record.exists() else []:
        name, ninja = line.split("\t")
        if name not in seen and not (env.FLASHINFER_AOT_DIR / name / f"{name}.so").exists():
            seen[name] = ninja
    print(f"fi_jit: {len(seen)} modules to build: {' '.join(sorted(seen))}", flush=True)
    if not seen:
        return 0
    names = sorted(seen, key=lambda n: (not n.startswith("batch_decode"), n))  # decode modules are quicker
    start = time.monotonic()
    out = ""
    for i in range(0, len(names), group):
        left = seconds - (time.monotonic() - start)
        if left <= 0:
            print(f"fi_jit: stopped after {seconds:.0f} s", flush=True)
            break
        top = env.FLASHINFER_JIT_DIR / f"fi_jit_group{i // group}.ninja"
        top.parent.mkdir(parents=True, exist_ok=True)
        top.write_text("\n".join(["ninja_required_version = 1.3", *(f"subninja {seen[n]}" for n in names[i:i + group])]) + "\n")
        proc = subprocess.Popen(["ninja", "-C", str(env.FLASHINFER_JIT_DIR), "-f", str(top), "-k", "0",
                                 "-j", str(jobs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out += proc.communicate(timeout=left)[0]
        except subprocess.TimeoutExpired:
            proc.terminate()
            out += proc.communicate()[0]
            print(f"fi_jit: stopped after {seconds:.0f} s", flush=True)
            break
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    built = [n for n in seen if (env.FLASHINFER_JIT_DIR / n / f"{n}.so").exists()]
    print(f"fi_jit: built {len(built)}/{len(seen)} in {time.monotonic() - start:.0f} s; "
          f"{len(failed)} failed", flush=True)
    for ln in failed[:20]:
        print("  " + ln)
    return 0


def pack(out: Path, tag: str, max_parts: int, max_bytes: int) -> int:
    """Every JIT-built module not already an AOT module, each xz-compressed, bundled in tar parts
    of at most 15 MiB (`fi-aot-<tag>-<i>.tar`), no more than `max_parts` parts and `max_bytes`."""
    env = _jit_env()
    sos = sorted(p for p in env.FLASHINFER_JIT_DIR.glob("*/*.so")
                 if p.stem == p.parent.name and not (env.FLASHINFER_AOT_DIR / p.stem).exists())
    stage = env.FLASHINFER_JIT_DIR.parent / "fi_jit_pack"
    subprocess.run(["rm", "-rf", str(stage)], check=True)
    stage.mkdir(parents=True)
    procs = [subprocess.Popen(f"xz -6 -c {so} > {stage / so.stem}.so.xz", shell=True) for so in sos]
    for proc in procs:
        proc.wait()
    parts: list[list[Path]] = []
    part_bytes: list[int] = []
    total, left = 0, []
    for xz in sorted(stage.glob("*.so.xz"), key=lambda f: f.stat().st_size):
        n = xz.stat().st_size
        if n > PART_BYTES or total + n > max_bytes:
            left.append(xz.name)
            continue
        if not parts or part_bytes[-1] + n > PART_BYTES:
            if len(parts) == max_parts:
                left.append(xz.name)
                continue
            parts.append([])
            part_bytes.append(0)
        parts[-1].append(xz)
        part_bytes[-1] += n
        total += n
    out.mkdir(parents=True, exist_ok=True)
    for i, files in enumerate(parts):
        subprocess.run(["tar", "-C", str(stage), "-cf", str(out / f"fi-aot-{tag}-{i}.tar"),
                        *[f.name for f in files]], check=True)
    print(f"fi_jit: packed {sum(map(len, parts))} modules, {total / 2**20:.1f} MiB; "
          f"left behind {len(left)}: {' '.join(left)}")
    return 0


def install(src: Path) -> int:
    """Unpack every `fi-aot-*.tar` under `src` into FlashInfer's AOT directory."""
    env = _jit_env()
    (src / "x").mkdir(parents=True, exist_ok=True)
    for tar in sorted(src.glob("fi-aot-*.tar")):
        subprocess.run(["tar", "-C", str(src / "x"), "-xf", str(tar)], check=True)
    for xz in sorted((src / "x").glob("*.so.xz")):
        name = xz.name[: -len(".so.xz")]
        (env.FLASHINFER_AOT_DIR / name).mkdir(parents=True, exist_ok=True)
        subprocess.run(f"xz -dc {xz} > {env.FLASHINFER_AOT_DIR / name / name}.so", shell=True, check=True)
    subprocess.run(["rm", "-rf", str(src / "x")], check=True)
    count = len(list(env.FLASHINFER_AOT_DIR.glob("*/*.so")))
    print(f"fi_jit: {count} AOT modules in {env.FLASHINFER_AOT_DIR}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--record", type=Path, default=Path(os.environ.get(RECORD_ENV, "fi_jit_record.tsv")))
    b.add_argument("--seconds", type=float, default=400)
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 8)
    k = sub.add_parser("pack")
    k.add_argument("out", type=Path)
    k.add_argument("--tag", default=time.strftime("%H%M%S"))
    k.add_argument("--max-parts", type=int, default=4)
    k.add_argument("--max-bytes", type=int, default=56 << 20)
    i = sub.add_parser("install")
    i.add_argument("src", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "build":
        return build(a.record, a.seconds, a.jobs)
    if a.cmd == "pack":
        return pack(a.out, a.tag, a.max_parts, a.max_bytes)
    return install(a.src)


if __name__ == "__main__":
    sys.exit(main())
