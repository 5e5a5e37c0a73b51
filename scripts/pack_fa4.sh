#!/usr/bin/env bash
# Pack FA4 (flash-attn-4 over nvidia-cutlass-dsl, CUDA 13 build) for the GPU machine, which has no
# network and takes at most 64 MiB per call. Its one large file, the CuTe DSL compiler
# (_cutlass_ir.cu13...so, 193 MB, already stripped), is xz -9 compressed (48 MiB) and split in two:
# .fa4a/ holds the first 38 MiB (carry it beside .peers in one call), .fa4b/ the rest with the
# runtime library (libcute_dsl_runtime.so, 13 MiB compressed) and every other file of the wheels
# (4 MiB) (carry it in the next call, on the same warm machine). `gpu_check.sh fa4` reassembles
# them under /tmp/fa4site and runs scripts/fa4_probe.py. Run here, in the repository root.
set -euo pipefail
W=${W:-/tmp/fa4}
mkdir -p "$W" && cd "$W"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 -d . \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
  torch-c-dlpack-ext==0.1.5
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
RT=nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so
rm -rf site && mkdir site
for w in *.whl; do unzip -q -o "$w" -d site; done
xz -9 -T0 -c "site/$IR" > ir.so.xz
xz -9 -T0 -c "site/$RT" > rt.xz
rm "site/$IR" "site/$RT"
tar cJf small.tar.xz -C site .
rm -f ir.xz.part-* && split -b 38m ir.so.xz ir.xz.part-
cd - > /dev/null
rm -rf .fa4a .fa4b && mkdir .fa4a .fa4b
cp "$W"/ir.xz.part-aa .fa4a/ && cp "$W"/ir.xz.part-a[b-z] "$W"/rt.xz "$W"/small.tar.xz .fa4b/
grep -qx "/.fa4a/" .git/info/exclude || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
du -sh .fa4a .fa4b
