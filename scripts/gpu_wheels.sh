#!/usr/bin/env bash
# `make gpu-wheels`: the server's Python packages as wheels for the GPU image
# (CPython 3.12, x86-64 manylinux), which has none of fastapi, uvicorn,
# pydantic or httpx2 and reaches no registry. Writes .whl/ (git-ignored via
# .git/info/exclude); carry it to the GPU machine (the device tool's `carry`)
# and `make gpu-check` installs it before its bench-serve step.
#
# The versions are the ones this checkout's .venv runs (so the GPU serves with
# what the tests here ran), each with --no-deps, so the list names every
# dependency of the server and of bench serve's client, also those the image
# has (click, prometheus-client), and the less obvious ones (fastapi needs
# opentelemetry-api, httpx2 truststore): installed into an empty folder on a
# bare CPython 3.12, fastapi, uvicorn, httpx2 and prometheus_client import.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
NAMES="fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection
typing_extensions uvicorn click httpx2 httpcore2 anyio h11 sniffio idna opentelemetry-api truststore prometheus-client"
pins=()
for n in $NAMES; do
  v=$("$VPY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n") || {
    echo "gpu-wheels: $n is not installed in $VPY (make build first)" >&2; exit 1; }
  pins+=("$n==$v")
done
exclude=$(git rev-parse --git-path info/exclude)   # .git may be a file (a worktree)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls .whl
