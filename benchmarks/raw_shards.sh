#!/usr/bin/env bash
# Issue 36's one-GPU figures: small images streamed from raw-pixel shards against JPEG shards and
# synthetic data (resnet18 at 32 px, global batch 512, bf16), and the one-time decode of held data.
#
#   bash benchmarks/raw_shards.sh OUT          # run from the repository root; everything goes under OUT
#
# Steps (each step's command is in OUT/log.txt; about 6 minutes on one H200 with 16 cores, raw-large not
# counted; steps 1-2 run only for the rows that read them):
#   1. benchmarks/make_images.py: CLASSES x TRAIN_PER_CLASS train + VAL_PER_CLASS val PNGs of SIZE x SIZE
#      (default 10 x 7000 + 100, 32 x 32: 71,000 images)                          -> $WORK/images
#   2. rayconv.prepare's work (local processes) at --size SIZE, --encoding raw and jpeg -> $WORK/raw, $WORK/jpeg
#   3. python -m rayconv.bench rows (--steps STEPS --warmup WARMUP): synthetic; raw shards streamed
#      (--data-on-device off); JPEG shards streamed (--data-on-device off, --decode cpu)
#   3a. raw-even: benchmarks/make_raw_shards.py writes EVEN_IMAGES (default 140 batches of BATCH: 71,680 at
#      512) + CLASSES x VAL_PER_CLASS generated SIZE x SIZE images of CLASSES into raw shards (-> $WORK/even),
#      streamed as raw-off is: the same epoch ends but no partial batch (an epoch's last step a full one)
#   3b. raw-large: benchmarks/make_raw_shards.py writes LARGE_IMAGES (default 1,280,000: ImageNet-32-sized,
#      3.9 GB at 32 px) + LARGE_VAL (default 10,000) generated SIZE x SIZE images of LARGE_CLASSES (default
#      1000) into raw shards (-> $WORK/large, removed after the row unless KEEP=1), then a bench row streams
#      them (--data-on-device off) for LARGE_STEPS steps (default: as many as make the timed steps and the
#      bench's in-actor loop of as many read the train set once) under benchmarks/rss_watch.py (the
#      actor's private memory, RssAnon, sampled every 0.5 s)
#   4. python -m rayconv.run rows (RUN_STEPS steps, --compile off) with the data held on the device
#      (--data-on-device on): the image folder and the JPEG shards; their summary.json's startup says how
#      long the one-time decode took and on how many workers
#   5. OUT/report.md: images/s, x synthetic, input stall, the mean and median timed step and the in-actor
#      loop's step of each bench row (a mean well above the median: a few slow steps, e.g. epoch ends), its warm-up
#      steps (the whole first epoch when it ends in a partial batch: bench.measure.warmup_steps); decode seconds, workers
#      and images/s of each run row; raw-large's private memory at its first timed step (placed from the
#      row's own step times, back from the actor's last sample), at the end and at its peak, against the
#      bytes its measured steps read (flat: the growth small against those)
#
# Rows that would start after BUDGET seconds (default 420) are skipped and say so; ROWS (default all:
# "synthetic raw-off jpeg-off raw-large folder-held jpeg-held"; raw-even only when named) picks some. Env: EVEN_IMAGES,
# WORK (default OUT/work,
# removed at the end unless KEEP=1), CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, SIZE, STEPS (default 300),
# WARMUP (default 20), RUN_STEPS (default 20), LARGE_IMAGES, LARGE_VAL, LARGE_CLASSES, LARGE_STEPS, DEVICE
# (auto: cuda when nvidia-smi sees a GPU; cpu: a smoke check with the small ConvNet at batch 32), PYTHON
# (default python3). A CPU try (one row: under a minute on an idle 2-core machine; leave ROWS out for all
# six, each a Ray start):
#   DEVICE=cpu CLASSES=2 TRAIN_PER_CLASS=48 VAL_PER_CLASS=4 STEPS=3 WARMUP=1 RUN_STEPS=3 ROWS=raw-off \
#     bash benchmarks/raw_shards.sh /tmp/raw-bench
# and of raw-large alone (about a minute there):
#   DEVICE=cpu LARGE_IMAGES=5000 LARGE_VAL=200 LARGE_CLASSES=10 WARMUP=2 ROWS=raw-large \
#     bash benchmarks/raw_shards.sh /tmp/raw-large
set -euo pipefail

if [[ $# -ne 1 ]]; then sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; fi
if [[ ! -f rayconv/bench/__main__.py ]]; then echo "raw_shards.sh: run it from the repository root" >&2; exit 2; fi
OUT=$1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-$OUT/work}
CLASSES=${CLASSES:-10}; TRAIN_PER_CLASS=${TRAIN_PER_CLASS:-7000}; VAL_PER_CLASS=${VAL_PER_CLASS:-100}
SIZE=${SIZE:-32}; STEPS=${STEPS:-300}; WARMUP=${WARMUP:-20}; RUN_STEPS=${RUN_STEPS:-20}; BUDGET=${BUDGET:-420}
LARGE_IMAGES=${LARGE_IMAGES:-1280000}; LARGE_VAL=${LARGE_VAL:-10000}; LARGE_CLASSES=${LARGE_CLASSES:-1000}
DEVICE=${DEVICE:-auto}
if [[ $DEVICE == auto ]]; then
  DEVICE=cpu; command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && DEVICE=cuda
fi
if [[ $DEVICE == cuda ]]; then
  MODEL=resnet18; BATCH=512; PREC=bf16
else
  MODEL=convnet_bn; BATCH=32; PREC=fp32
fi
LARGE_STEPS=${LARGE_STEPS:-$(( (LARGE_IMAGES + 2 * BATCH - 1) / (2 * BATCH) ))}
EVEN_IMAGES=${EVEN_IMAGES:-$(( 140 * BATCH ))}
mkdir -p "$OUT" "$WORK"
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$WORK"' EXIT
IMAGES=$WORK/images RAW=$WORK/raw JPEG=$WORK/jpeg LOG=$OUT/log.txt
log() { echo "raw_shards.sh: $*" | tee -a "$LOG" >&2; }
t0=$SECONDS
ROWS=" ${ROWS:-synthetic raw-off jpeg-off raw-large folder-held jpeg-held} "
picked() { [[ $ROWS == *" $1 "* ]]; }
late() {  # late ROW: past BUDGET seconds, ROW is skipped (so that the script ends within its call)
  if (( SECONDS - t0 > BUDGET )); then log "$1: skipped ($((SECONDS - t0)) s > BUDGET $BUDGET s)"; return 0; fi
  return 1
}

# 1-2. the images and their shards, raw and JPEG (for the rows that read them)
if picked raw-off || picked jpeg-off || picked folder-held || picked jpeg-held; then
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
fi

COMMON=(--models "$MODEL" --layouts 1gpu --global-batch-size "$BATCH" --image-size "$SIZE" --precision "$PREC"
        --device "$DEVICE" --warmup "$WARMUP" --no-anchors)
bench() {  # bench ROW ARGS...: one rayconv.bench row of ROW_STEPS (default STEPS) steps; WATCH=1: under rss_watch.py
  local row=$1; shift
  picked "$row" || return 0
  late "$row" && return 0
  local steps=${ROW_STEPS:-$STEPS} watch=()
  if [[ ${WATCH:-0} == 1 ]]; then mkdir -p "$OUT/$row"; watch=("$PY" benchmarks/rss_watch.py "$OUT/$row/rss.json" --); fi
  log "$row: python -m rayconv.bench ${COMMON[*]} --steps $steps $* --out $OUT/$row ($((SECONDS - t0)) s so far)"
  "${watch[@]}" "$PY" -u -m rayconv.bench "${COMMON[@]}" --steps "$steps" "$@" --out "$OUT/$row" >> "$LOG" 2>&1 \
    || log "$row: failed (see $LOG)"
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
# 3a. a generated set of whole batches only (no partial batch at an epoch's end)
if picked raw-even && ! late raw-even; then
  EVEN=$WORK/even
  log "raw-even: python benchmarks/make_raw_shards.py $EVEN --images $EVEN_IMAGES --size $SIZE --classes $CLASSES" \
    "--val $(( CLASSES * VAL_PER_CLASS )) ($((SECONDS - t0)) s so far)"
  if "$PY" benchmarks/make_raw_shards.py "$EVEN" --images "$EVEN_IMAGES" --size "$SIZE" --classes "$CLASSES" \
      --val $(( CLASSES * VAL_PER_CLASS )) > "$OUT/make-even.txt" 2>&1; then
    cat "$EVEN"/*.arrow > /dev/null
    bench raw-even --data shards --data-dir "$EVEN" --data-on-device off
  else
    cat "$OUT/make-even.txt" >> "$LOG"; log "raw-even: make_raw_shards.py failed (see $LOG)"
  fi
fi
# 3b. a generated set of LARGE_IMAGES images, streamed, the actor's private memory watched
if picked raw-large && ! late raw-large; then
  LARGE=$WORK/large
  log "raw-large: python benchmarks/make_raw_shards.py $LARGE --images $LARGE_IMAGES --size $SIZE" \
    "--classes $LARGE_CLASSES --val $LARGE_VAL ($((SECONDS - t0)) s so far)"
  if "$PY" benchmarks/make_raw_shards.py "$LARGE" --images "$LARGE_IMAGES" --size "$SIZE" --classes "$LARGE_CLASSES" \
      --val "$LARGE_VAL" > "$OUT/make-large.txt" 2>&1; then
    tail -1 "$OUT/make-large.txt" | tee -a "$LOG"
    cat "$LARGE"/*.arrow > /dev/null   # (as the other rows: the page cache is warm)
    ROW_STEPS=$LARGE_STEPS WATCH=1 bench raw-large --data shards --data-dir "$LARGE" --data-on-device off
  else
    cat "$OUT/make-large.txt" >> "$LOG"; log "raw-large: make_raw_shards.py failed (see $LOG)"
  fi
  [[ ${KEEP:-0} == 1 ]] || rm -rf "$LARGE"
fi
# 4. the one-time decode of held data
run_row folder-held --data imagefolder --data-dir "$IMAGES"
run_row jpeg-held --data shards --data-dir "$JPEG"

# 5. the report
"$PY" - "$OUT" "$SIZE" "$BATCH" "$LARGE_STEPS" <<'EOF' | tee "$OUT/report.md"
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
out, size, batch, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fmt = lambda v, p="{:.0f}": "-" if v is None else p.format(v)
bench = {}
for d in ("synthetic", "raw-off", "raw-even", "jpeg-off", "raw-large"):
    f = out / d / "bench.parquet"
    if (out / d).is_dir():
        bench[d] = pq.read_table(f).to_pylist()[0] if f.is_file() else {"note": "failed (log.txt says why)"}
synth = bench.get("synthetic", {}).get("images_per_s")
print("| row | images/s | x synthetic | input stall | step ms, mean / median | in-actor step ms | warm-up steps | note |\n"
      "|---|---|---|---|---|---|---|---|")
for d, r in bench.items():
    ips = r.get("images_per_s")
    print(f"| {d} | {fmt(ips)} | {fmt(ips / synth if ips and synth else None, '{:.2f}')} | "
          f"{fmt(r.get('input_stall_fraction'), '{:.1%}')} | {fmt(r.get('step_ms'), '{:.2f}')} / "
          f"{fmt(r.get('step_ms_median'), '{:.2f}')} | {fmt(r.get('in_actor_step_ms'), '{:.2f}')} | {fmt(r.get('warmup_steps'))} | {r.get('note') or ''} |")
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
large, watch = bench.get("raw-large", {}), out / "raw-large" / "rss.json"
if watch.is_file() and large.get("step_ms"):
    # The actor (the largest peak of the ray::Actor processes); its first timed step placed back from its
    # last sample (the actor is stopped after the profiled steps) by the row's timed and in-actor loop times.
    rss = json.loads(watch.read_text())
    actors = [p for p, t in rss["titles"].items() if t.startswith("ray::Actor")] or list(rss["titles"])
    pid = max(actors, key=lambda p: rss["actors"][p])
    readers = [p for p, t in rss["titles"].items() if t == "rayconv.data.raw_reader"]
    measured_s = steps * (large["step_ms"] + large["in_actor_step_ms"]) / 1e3
    first = rss["samples"][pid][-1][0] - measured_s
    read_mib = 2 * steps * batch * size * size * 3 / 2**20   # the timed steps and the in-actor loop
    print("\n| raw-large private memory (RssAnon, MiB) | at the first timed step | end | peak | growth | "
          "bytes read by the measured steps (MiB) | samples |\n|---|---|---|---|---|---|---|")
    for who, p in [("actor", pid)] + [("its reader process", r) for r in readers]:
        samples = rss["samples"][p]
        start = next((s for s in samples if s[0] >= first), samples[-1])
        end, peak = samples[-1][1], max(s[1] for s in samples)
        print(f"| {who} {p} | {start[1]:.0f} (t {start[0]:.1f} s) | {end:.0f} (t {samples[-1][0]:.1f} s) | "
              f"{peak:.0f} | {end - start[1]:+.0f} | {read_mib:.0f} | {len(samples)} |")
p = out / "make-large.txt"
if p.is_file():
    print("\n" + p.read_text().strip().splitlines()[-1])
EOF
log "done in $((SECONDS - t0)) s: $OUT/report.md"
