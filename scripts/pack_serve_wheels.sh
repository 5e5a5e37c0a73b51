#!/usr/bin/env bash
# Add the serving stack the GPU machine's image lacks (FastAPI, uvicorn, pydantic and their missing
# dependencies; 3 MiB of cp312 wheels; httpx, anyio, click, h11 and prometheus_client are there
# already, see the device library's KINDS.md) to .peers/wheels, so `pagedattn serve` and the online
# part of `pagedattn bench engine` run there; and the `openai` client with what it needs beyond
# the image (httpx2, httpcore2, truststore, jiter, sniffio: 3 MiB more), for the serve check of
# scripts/tp_gpu_check.py. .peers/activate.sh installs every wheel on first use.
# Run here, in the repository root, after ../shared/tools/device-peers.sh.
set -euo pipefail
[ -d .peers/wheels ] || { echo "no .peers/wheels: run ../shared/tools/device-peers.sh first" >&2; exit 2; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .peers/wheels \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1
du -sh .peers
