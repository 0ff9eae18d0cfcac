#!/usr/bin/env bash
# Issue 24's one-GPU figures: ResNet-50 at global batch 256 on memory-mapped shards of >= 200,000 generated
# JPEGs (shorter side 256) against synthetic data, from a warm and from a cold page cache, with each
# row's input stall and the actors' peak private memory (RssAnon); prepare's images/s per core.
#
#   bash benchmarks/shards_scale.sh OUT          # run from the repository root; everything goes under OUT
#
# Steps (about 8 minutes on one H200 with 16 cores; each step's command is in OUT/log.txt):
#   1. benchmarks/make_images.py: CLASSES x TRAIN_PER_CLASS train + VAL_PER_CLASS val JPEGs, WIDTH x HEIGHT
#      (default 1000 x 200 + 10, 341 x 256)                                       -> $WORK/jpegs
#   2. python -m rayconv.prepare (its last line: images/s per core)              -> $WORK/shards
#   3. python -m rayconv.bench rows (--steps STEPS --warmup WARMUP), each under benchmarks/rss_watch.py:
#      synthetic; shards (default order) warm; shards cold (posix_fadvise DONTNEED on every shard first)
#   4. if `python -m rayconv.run --help` offers --shuffle: python -m rayconv.run rows (STEPS + WARMUP steps)
#      for --shuffle block warm and cold, and the default order warm for comparison
#   5. OUT/report.md: one line a row (images/s and input stall, of a run row's steps after the first WARMUP
#      as in the bench rows, from its metrics.parquet; the ratio to the bench's synthetic row; peak RssAnon
#      of the actors and loader processes) and prepare's rate
#
# Rows that would start after BUDGET seconds (default 480) are skipped and say so; ROWS (default: all six,
# "synthetic shards-warm shards-cold run-exact-warm run-block-warm run-block-cold") picks some of them.
# Env: WORK (default OUT/work: the JPEGs and shards, about 15 GB at the defaults; removed at the end unless
# KEEP=1), CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, WIDTH, HEIGHT, STEPS (default 30), WARMUP (default 5),
# DEVICE (auto: cuda when nvidia-smi sees a GPU; cpu: a smoke check with the small ConvNet at 32 px, batch
# 32), PYTHON (default python3). A tiny CPU try:
#   DEVICE=cpu CLASSES=4 TRAIN_PER_CLASS=40 VAL_PER_CLASS=4 WIDTH=64 HEIGHT=48 STEPS=3 WARMUP=1 \
#     bash benchmarks/shards_scale.sh /tmp/scale
set -euo pipefail

if [[ $# -ne 1 ]]; then sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; fi
if [[ ! -f rayconv/bench/__main__.py ]]; then echo "shards_scale.sh: run it from the repository root" >&2; exit 2; fi
OUT=$1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK=${WORK:-$OUT/work}
CLASSES=${CLASSES:-1000}; TRAIN_PER_CLASS=${TRAIN_PER_CLASS:-200}; VAL_PER_CLASS=${VAL_PER_CLASS:-10}
WIDTH=${WIDTH:-341}; HEIGHT=${HEIGHT:-256}; STEPS=${STEPS:-30}; WARMUP=${WARMUP:-5}; BUDGET=${BUDGET:-480}
DEVICE=${DEVICE:-auto}
if [[ $DEVICE == auto ]]; then
  DEVICE=cpu; command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && DEVICE=cuda
fi
if [[ $DEVICE == cuda ]]; then
  MODEL=resnet50; SIZE=224; BATCH=256; PREC=bf16
else
  MODEL=convnet_bn; SIZE=32; BATCH=32; PREC=fp32
fi
mkdir -p "$OUT" "$WORK"
[[ ${KEEP:-0} == 1 ]] || trap 'rm -rf "$WORK"' EXIT   # (the JPEGs and shards do not stay under OUT)
JPEGS=$WORK/jpegs SHARDS=$WORK/shards LOG=$OUT/log.txt
log() { echo "shards_scale.sh: $*" | tee -a "$LOG" >&2; }
t0=$SECONDS

# 1-2. the images and their shards
log "make_images: $CLASSES classes x ($TRAIN_PER_CLASS + $VAL_PER_CLASS), ${WIDTH}x${HEIGHT} -> $JPEGS"
[[ -d $JPEGS/val ]] || "$PY" benchmarks/make_images.py "$JPEGS" --classes "$CLASSES" --train-per-class "$TRAIN_PER_CLASS" \
  --val-per-class "$VAL_PER_CLASS" --width "$WIDTH" --height "$HEIGHT" 2>&1 | tee -a "$LOG"
log "prepare: python -m rayconv.prepare $JPEGS --out $SHARDS ($((SECONDS - t0)) s so far)"
"$PY" -m rayconv.prepare "$JPEGS" --out "$SHARDS" > "$OUT/prepare.txt" 2>&1 || { cat "$OUT/prepare.txt" >&2; exit 1; }
tail -2 "$OUT/prepare.txt" | tee -a "$LOG"

warm() { cat "$SHARDS"/*.arrow > /dev/null; }
cold() {  # every shard's cached pages dropped (no privileges needed: posix_fadvise DONTNEED)
  sync
  "$PY" -c 'import glob, os, sys
for p in glob.glob(sys.argv[1] + "/*.arrow"):
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$SHARDS"
}
COMMON=(--models "$MODEL" --layouts 1gpu --global-batch-size "$BATCH" --image-size "$SIZE" --precision "$PREC"
        --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" --no-anchors)
late() {  # late ROW: past BUDGET seconds, ROW is skipped (so that the script ends within its call)
  if (( SECONDS - t0 > BUDGET )); then log "$1: skipped ($((SECONDS - t0)) s > BUDGET $BUDGET s)"; return 0; fi
  return 1
}
ROWS=" ${ROWS:-synthetic shards-warm shards-cold run-exact-warm run-block-warm run-block-cold} "
picked() { [[ $ROWS == *" $1 "* ]]; }
bench() {  # bench ROW ARGS...: one rayconv.bench row under the RssAnon watcher
  local row=$1; shift
  picked "$row" || return 0
  late "$row" && return 0
  log "$row: python -m rayconv.bench ${COMMON[*]} $* --out $OUT/$row ($((SECONDS - t0)) s so far)"
  "$PY" benchmarks/rss_watch.py "$OUT/$row/rss.json" -- "$PY" -u -m rayconv.bench "${COMMON[@]}" "$@" --out "$OUT/$row" \
    >> "$LOG" 2>&1 || log "$row: failed (see $LOG)"
}
# 3. bench rows
bench synthetic
picked shards-warm && warm; bench shards-warm --data shards --data-dir "$SHARDS"
picked shards-cold && cold; bench shards-cold --data shards --data-dir "$SHARDS"

# 4. --shuffle block through rayconv.run, where the flag exists
run_row() {  # run_row ROW ARGS...: one rayconv.run (summary.json) under the RssAnon watcher
  local row=$1; shift
  picked "$row" || return 0
  late "$row" && return 0
  rm -rf "$OUT/$row"; mkdir -p "$OUT/$row.d"
  local args=(--model "$MODEL" --data shards --data-dir "$SHARDS" --image-size "$SIZE" --global-batch-size "$BATCH"
              --precision "$PREC" --device "$DEVICE" --steps "$((STEPS + WARMUP))" --no-progress --out "$OUT/$row")
  log "$row: python -m rayconv.run ${args[*]} $* ($((SECONDS - t0)) s so far)"
  "$PY" benchmarks/rss_watch.py "$OUT/$row.d/rss.json" -- "$PY" -u -m rayconv.run "${args[@]}" "$@" >> "$LOG" 2>&1 \
    || log "$row: failed (see $LOG)"
  rm -f "$OUT/$row/model.pt"
}
if "$PY" -m rayconv.run --help 2>/dev/null | grep -q -- '--shuffle'; then
  picked run-exact-warm && warm; run_row run-exact-warm
  picked run-block-warm && warm; run_row run-block-warm --shuffle block
  picked run-block-cold && cold; run_row run-block-cold --shuffle block
else
  log "rayconv.run has no --shuffle: the --shuffle block rows are skipped"
fi

# 5. the report
"$PY" - "$OUT" "$WARMUP" "$BATCH" <<'EOF' | tee "$OUT/report.md"
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
out, warmup, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def rss(p):
    return json.loads(p.read_text()).get("max_mib") if p.is_file() else None
rows = []
for d in ("synthetic", "shards-warm", "shards-cold"):
    f = out / d / "bench.parquet"
    if (out / d).is_dir():
        r = pq.read_table(f).to_pylist()[0] if f.is_file() else {}
        rows.append((d, r.get("images_per_s"), r.get("input_stall_fraction"), rss(out / d / "rss.json"),
                     r.get("note") if f.is_file() else "failed (log.txt says why)"))
for d in ("run-exact-warm", "run-block-warm", "run-block-cold"):
    # a run row's steady steps (after the bench rows' WARMUP steps), from its metrics.parquet
    f = out / d / "metrics.parquet"
    if (out / f"{d}.d").is_dir():
        steps = [r for r in pq.read_table(f).to_pylist() if r["kind"] == "train" and r["step"] >= warmup] \
            if f.is_file() else []
        ips = batch * len(steps) / sum(r["step_ms"] / 1e3 for r in steps) if steps else None
        stall = sum(r["input_stall_fraction"] for r in steps) / len(steps) if steps else None
        rows.append((d, ips, stall, rss(out / f"{d}.d" / "rss.json"), None if steps else "failed"))
synth = next((r[1] for r in rows if r[0] == "synthetic"), None)
fmt = lambda v, p="{:.0f}": "-" if v is None else p.format(v)
print(f"| row | images/s | x synthetic | input stall | peak RssAnon, any actor or loader process (MiB) | note |")
print("|---|---|---|---|---|---|")
for d, ips, stall, mib, note in rows:
    ratio = ips / synth if ips and synth else None
    print(f"| {d} | {fmt(ips)} | {fmt(ratio, '{:.2f}')} | {fmt(stall, '{:.1%}')} | {fmt(mib)} | {note or ''} |")
prep = (out / "prepare.txt").read_text().strip().splitlines()
print("\n" + "\n".join(prep[-2:]))
EOF
log "done in $((SECONDS - t0)) s: $OUT/report.md"
