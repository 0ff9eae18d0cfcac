#!/usr/bin/env bash
# Packages that `ray.tune` imports and the GPU machine lacks, for runs of rayconv.tune there
# (benchmarks/tune_pack.sh): Ray 2.58's `ray.tune` imports pandas, and its `ray.train` requires pydantic.
# That machine reaches no registry and runs Python 3.12; this machine downloads their cp312 wheels and
# packs their files as one xz tar (a wheel is a zip of the files it installs; xz makes the carry smaller).
#   bash benchmarks/device_wheels.sh [TAR]     # here, from the repository root; TAR: .device/tune-deps.tar.xz
# Then, on the GPU machine, after its Ray is set up on PYTHONPATH (its site folder SITE, /tmp/site):
#   tar -xJf TAR -C SITE
set -euo pipefail
TAR=${1:-.device/tune-deps.tar.xz}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WORK/wheels" \
  pydantic pydantic-core annotated-types typing-extensions typing-inspection \
  pandas python-dateutil pytz tzdata six 2>&1 | grep -v '^WARNING: Location' || true
mkdir -p "$WORK/site" "$(dirname "$TAR")"
for w in "$WORK"/wheels/*.whl; do python3 -m zipfile -e "$w" "$WORK/site"; done
tar -cf - -C "$WORK/site" . | xz -6 -T2 > "$TAR"
ls "$WORK"/wheels
du -h "$TAR"
