#!/usr/bin/env bash
# Issue 36's one-GPU figures: small images streamed from raw-pixel shards against JPEG shards and
# synthetic data (resnet18 at 32 px, global batch 512, bf16), and the one-time decode of held data.
#
#   bash benchmarks/raw_shards.sh OUT          # run from the repository root; everything goes under OUT
#
# Steps (each step's command is in OUT/log.txt; about 6 minutes on one H200 with 16 cores):
#   1. benchmarks/make_images.py: CLASSES x TRAIN_PER_CLASS train + VAL_PER_CLASS val PNGs of SIZE x SIZE
#      (default 10 x 7000 + 100, 32 x 32: 71,000 images)                          -> $WORK/images
#   2. rayconv.prepare's work (local processes) at --size SIZE, --encoding raw and jpeg -> $WORK/raw, $WORK/jpeg
#   3. python -m rayconv.bench rows (--steps STEPS --warmup WARMUP): synthetic; raw shards streamed
#      (--data-on-device off); JPEG shards streamed (--data-on-device off, --decode cpu)
#   4. python -m rayconv.run rows (RUN_STEPS steps, --compile off) with the data held on the device
#      (--data-on-device on): the image folder and the JPEG shards; their summary.json's startup says how
#      long the one-time decode took and on how many workers
#   5. OUT/report.md: images/s, x synthetic and input stall of each bench row; decode seconds, workers
#      and images/s of each run row
#
# Rows that would start after BUDGET seconds (default 420) are skipped and say so; ROWS (default all:
# "synthetic raw-off jpeg-off folder-held jpeg-held") picks some. Env: WORK (default OUT/work, removed at
# the end unless KEEP=1), CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, SIZE, STEPS (default 300), WARMUP
# (default 20), RUN_STEPS (default 20), DEVICE (auto: cuda when nvidia-smi sees a GPU; cpu: a smoke check
# with the small ConvNet at batch 32), PYTHON (default python3). A CPU try (one row: under a minute on an
# idle 2-core machine; leave ROWS out for all five, each a Ray start):
#   DEVICE=cpu CLASSES=2 TRAIN_PER_CLASS=48 VAL_PER_CLASS=4 STEPS=3 WARMUP=1 RUN_STEPS=3 ROWS=raw-off \
#     bash benchmarks/raw_shards.sh /tmp/raw-bench
set -euo pipefail

if [[ $# -ne 1 ]]; then sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; fi
if [[ ! -f rayconv/bench/__main__.py ]]; then echo "raw_shards.sh: run it from the repository root" >&2; exit 2; fi
OUT=$1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-$OUT/work}
CLASSES=${CLASSES:-10}; TRAIN_PER_CLASS=${TRAIN_PER_CLASS:-7000}; VAL_PER_CLASS=${VAL_PER_CLASS:-100}
SIZE=${SIZE:-32}; STEPS=${STEPS:-300}; WARMUP=${WARMUP:-20}; RUN_STEPS=${RUN_STEPS:-20}; BUDGET=${BUDGET:-420}
DEVICE=${DEVICE:-auto}
if [[ $DEVICE == auto ]]; then
  DEVICE=cpu; command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && DEVICE=cuda
fi
if [[ $DEVICE == cuda ]]; then
  MODEL=resnet18; BATCH=512; PREC=bf16
else
  MODEL=convnet_bn; BATCH=32; PREC=fp32
fi
mkdir -p "$OUT" "$WORK"
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$WORK"' EXIT
IMAGES=$WORK/images RAW=$WORK/raw JPEG=$WORK/jpeg LOG=$OUT/log.txt
log() { echo "raw_shards.sh: $*" | tee -a "$LOG" >&2; }
t0=$SECONDS

# 1-2. the images and their shards, raw and JPEG
log "make_images: $CLASSES classes x ($TRAIN_PER_CLASS + $VAL_PER_CLASS), ${SIZE}x${SIZE} -> $IMAGES"
[[ -d $IMAGES/val ]] || "$PY" benchmarks/make_images.py "$IMAGES" --classes "$CLASSES" \
  --train-per-class "$TRAIN_PER_CLASS" --val-per-class "$VAL_PER_CLASS" --width "$SIZE" --height "$SIZE" --format png 2>&1 | tee -a "$LOG"
for enc in raw jpeg; do
  dest=$WORK/$enc
  # (what `python -m rayconv.prepare $IMAGES --out $dest --size $SIZE --encoding $enc` runs, on local processes
  # instead of Ray tasks: one node, and no cluster start)
  log "prepare: rayconv.data.shard_writer.prepare $IMAGES -> $dest, size $SIZE, encoding $enc ($((SECONDS - t0)) s so far)"
  "$PY" -c 'import sys; from rayconv.data.shard_writer import prepare; from rayconv.prepare import default_shard_size
size, enc = int(sys.argv[3]), sys.argv[4]
prepare(sys.argv[1], sys.argv[2], size=size, encoding=enc, shard_size=default_shard_size(enc, size))' \
    "$IMAGES" "$dest" "$SIZE" "$enc" \
    > "$OUT/prepare-$enc.txt" 2>&1 || { cat "$OUT/prepare-$enc.txt" >&2; exit 1; }
  tail -2 "$OUT/prepare-$enc.txt" | tee -a "$LOG"
  cat "$dest"/*.arrow > /dev/null   # warm page cache: the rows measure the input path, not the disk
done

late() {  # late ROW: past BUDGET seconds, ROW is skipped (so that the script ends within its call)
  if (( SECONDS - t0 > BUDGET )); then log "$1: skipped ($((SECONDS - t0)) s > BUDGET $BUDGET s)"; return 0; fi
  return 1
}
ROWS=" ${ROWS:-synthetic raw-off jpeg-off folder-held jpeg-held} "
picked() { [[ $ROWS == *" $1 "* ]]; }
COMMON=(--models "$MODEL" --layouts 1gpu --global-batch-size "$BATCH" --image-size "$SIZE" --precision "$PREC"
        --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" --no-anchors)
bench() {  # bench ROW ARGS...: one rayconv.bench row
  local row=$1; shift
  picked "$row" || return 0
  late "$row" && return 0
  log "$row: python -m rayconv.bench ${COMMON[*]} $* --out $OUT/$row ($((SECONDS - t0)) s so far)"
  "$PY" -u -m rayconv.bench "${COMMON[@]}" "$@" --out "$OUT/$row" >> "$LOG" 2>&1 || log "$row: failed (see $LOG)"
}
run_row() {  # run_row ROW ARGS...: one rayconv.run (summary.json), data held on the device
  local row=$1; shift
  picked "$row" || return 0
  late "$row" && return 0
  rm -rf "$OUT/$row"
  local args=(--model "$MODEL" --image-size "$SIZE" --global-batch-size "$BATCH" --precision "$PREC" --device "$DEVICE"
              --steps "$RUN_STEPS" --compile off --data-on-device on --augment pad-crop --no-progress --out "$OUT/$row")
  log "$row: python -m rayconv.run ${args[*]} $* ($((SECONDS - t0)) s so far)"
  "$PY" -u -m rayconv.run "${args[@]}" "$@" >> "$LOG" 2>&1 || log "$row: failed (see $LOG)"
  rm -f "$OUT/$row/model.pt"
}
# 3. bench rows
bench synthetic
bench raw-off --data shards --data-dir "$RAW" --data-on-device off
bench jpeg-off --data shards --data-dir "$JPEG" --data-on-device off --decode cpu
# 4. the one-time decode of held data
run_row folder-held --data imagefolder --data-dir "$IMAGES"
run_row jpeg-held --data shards --data-dir "$JPEG"

# 5. the report
"$PY" - "$OUT" <<'EOF' | tee "$OUT/report.md"
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
out = Path(sys.argv[1])
fmt = lambda v, p="{:.0f}": "-" if v is None else p.format(v)
bench = {}
for d in ("synthetic", "raw-off", "jpeg-off"):
    f = out / d / "bench.parquet"
    if (out / d).is_dir():
        bench[d] = pq.read_table(f).to_pylist()[0] if f.is_file() else {"note": "failed (log.txt says why)"}
synth = bench.get("synthetic", {}).get("images_per_s")
print("| row | images/s | x synthetic | input stall | note |\n|---|---|---|---|---|")
for d, r in bench.items():
    ips = r.get("images_per_s")
    print(f"| {d} | {fmt(ips)} | {fmt(ips / synth if ips and synth else None, '{:.2f}')} | "
          f"{fmt(r.get('input_stall_fraction'), '{:.1%}')} | {r.get('note') or ''} |")
print("\n| held row | decoded images | decode s | decode workers | images/s (--compile off) |\n|---|---|---|---|---|")
for d in ("folder-held", "jpeg-held"):
    f = out / d / "summary.json"
    if f.is_file():
        s = json.loads(f.read_text())
        st = s.get("startup") or {}
        print(f"| {d} | {fmt(st.get('decoded_images'))} | {fmt(st.get('decode_s'), '{:.2f}')} | "
              f"{fmt(st.get('decode_workers'))} | {fmt(s.get('images_per_s'))} |")
    elif (out / "log.txt").is_file() and d in (out / "log.txt").read_text():
        print(f"| {d} | - | - | - | failed or skipped (log.txt says why) |")
for enc in ("raw", "jpeg"):
    p = out / f"prepare-{enc}.txt"
    if p.is_file():
        print(f"\n{enc}: " + " / ".join(p.read_text().strip().splitlines()[-2:]))
EOF
log "done in $((SECONDS - t0)) s: $OUT/report.md"
