#!/usr/bin/env bash
# Add the serving stack the GPU machine's image lacks (FastAPI, uvicorn, pydantic and their missing
# dependencies; 3 MiB of cp312 wheels; httpx, anyio, click, h11 and prometheus_client are there
# already, see the device library's KINDS.md) to .peers/wheels, so `pagedattn serve` and the online
# part of `pagedattn bench engine` run there. .peers/activate.sh installs every wheel on first use.
# Run here, in the repository root, after ../shared/tools/device-peers.sh.
set -euo pipefail
[ -d .peers/wheels ] || { echo "no .peers/wheels: run ../shared/tools/device-peers.sh first" >&2; exit 2; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .peers/wheels \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
du -sh .peers
