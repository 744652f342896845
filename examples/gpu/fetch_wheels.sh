#!/usr/bin/env bash
# Download (here, with network) the cp312 wheels the GPU machine lacks into ./.whl at the repo root.
# The H200 image has python3 3.12 + torch 2.11 + numpy + httpx/anyio/h11/uvloop/click but no
# fastapi/starlette/pydantic/uvicorn/httptools/pyzmq/msgspec, nor opentelemetry-api, which
# fastapi 0.165 imports (the testbed failed to start on an H100 without it, 2026-12-06);
# typing_extensions is carried at the 4.16 pydantic 2.14 asks for (the image's is not known).
# Each wheel's Requires-Dist is either here or in the image. About 10 MB in all.
set -eu
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PY:-python3}
for spec in fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
            typing-inspection==0.4.5 annotated-doc==0.0.7 uvicorn==0.54.0 httptools==0.9.0 pyzmq==27.3.0 \
            msgspec==0.23.0 opentelemetry-api==1.45.3 typing_extensions==4.16.0; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -la .whl
