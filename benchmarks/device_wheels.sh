#!/usr/bin/env bash
# Wheels that `ray.tune` imports and the GPU machine lacks, for runs of rayconv.tune there
# (benchmarks/tune_pack.sh): Ray 2.58's `ray.train` (which `ray.tune` imports) requires pydantic.
# That machine reaches no registry and runs Python 3.12; this machine downloads its cp312 wheels.
#   bash benchmarks/device_wheels.sh [DIR]     # here, from the repository root; DIR: .device/wheels
# Then, on the GPU machine, after its Ray is set up on PYTHONPATH (its site folder SITE):
#   for w in DIR/*.whl; do python3 -m zipfile -e "$w" SITE; done      # a wheel is a zip of its files
set -euo pipefail
DIR=${1:-.device/wheels}
mkdir -p "$DIR"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR" \
  pydantic 2>&1 | grep -v '^WARNING: Location' || true
ls "$DIR"/*.whl
du -sh "$DIR"
