#!/usr/bin/env bash
# Issue 35's one-GPU check: the same trials as ONE rayconv.tune search, packed (--gpus-per-actor SHARE,
# several trials on the GPU at once) against one after another with a whole GPU each (--gpus-per-actor 1
# --max-concurrent 1: the same command and machinery); and RQ4's selection at global batch BATCH, the
# learning rate and optimizer picked by val_accuracy, the chosen trial's test accuracy read once.
#   bash benchmarks/tune_pack.sh OUT [DATA_DIR]      # run from the repository root
# (On the GPU machine, whose Ray bundle lacks pandas and pydantic, carry benchmarks/device_wheels.sh's tar first.)
# Trials: LRS x OPTS (default 0.03,0.1,0.3,1.0 x sgd_nesterov,lars: 8), each RQ4's recipe
# (benchmarks/rq4_fashion.py's RECIPE: resnet18 at 32 px, --lr-scaling linear, --lr-warmup-epochs 5,
# bf16) for EPOCHS epochs with --val-split 0.1 and dp 1, scheduler fifo (every trial runs to its end,
# so both halves do the same work), --tensorboard off (the halves time training, not event files).
# Settings by environment: BATCH (4096; TINY 64), EPOCHS (30), LRS, OPTS, SHARE (0.25), CONCURRENT (trials at once
# when packed; default 1/SHARE: what Ray's fractional GPUs let onto one GPU), SEQUENTIAL=0 / PACKED=0
# (skip that half), PY (python3), TINY=1 (CPU: digits, convnet, 2 trials of STEPS steps, no GPU share).
# Output: OUT/{packed,sequential}/ (search folders: results.json, trial-<k>/), OUT/*.log, OUT/walls.txt
# (appended: the halves may run in two calls into one OUT, PACKED=0 then SEQUENTIAL=0),
# OUT/report.json, and one line per figure (report below).
set -uo pipefail
OUT=${1:?usage: tune_pack.sh OUT [DATA_DIR]}
DATA=${2:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}; EPOCHS=${EPOCHS:-30}; TINY=${TINY:-0}
SHARE=${SHARE:-0.25}; SEQUENTIAL=${SEQUENTIAL:-1}; PACKED=${PACKED:-1}
CONCURRENT=${CONCURRENT:-$($PY -c "print(max(1, int(1 / $SHARE + 1e-9)))")}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if [ "$TINY" = 1 ]; then
  LRS=${LRS:-0.05,0.1}; OPTS=${OPTS:-sgd_nesterov}; STEPS=${STEPS:-6}; BATCH=${BATCH:-64}
  RUN=(--data digits --model convnet --steps "$STEPS" --eval-every 3 --global-batch-size "$BATCH" --val-split 0.1
       --no-progress --log-every 100000)
  PACK=(); WHOLE=()            # (CPU actors take --num-cpus-per-actor; GPU shares need GPUs)
else
  LRS=${LRS:-0.03,0.1,0.3,1.0}; OPTS=${OPTS:-sgd_nesterov,lars}; BATCH=${BATCH:-4096}
  RECIPE=$($PY -c 'import sys; sys.path.insert(0, "benchmarks"); from rq4_fashion import RECIPE; print(RECIPE)') || exit 1
  # shellcheck disable=SC2206
  RUN=($RECIPE --data-dir "$DATA" --epochs "$EPOCHS" --global-batch-size "$BATCH" --val-split 0.1)
  PACK=(--gpus-per-actor "$SHARE"); WHOLE=(--gpus-per-actor 1)
fi
SPACE=$($PY -c "import json, sys; print(json.dumps({'lr': {'grid': [float(v) for v in sys.argv[1].split(',')]},
                                                    'opt': {'grid': sys.argv[2].split(',')}}))" "$LRS" "$OPTS")
COMMON=(--space "$SPACE" --scheduler fifo "${RUN[@]}" --dp 1 --tensorboard off --address local)
echo "tune_pack: BATCH $BATCH, space $SPACE, packed ${PACK[*]:-(cpu)} --max-concurrent $CONCURRENT" | tee -a "$OUT/walls.txt"

half() {   # half NAME FLAGS...: one search, its wall seconds into walls.txt
  local name=$1; shift
  local t0 t1; t0=$(date +%s.%N)
  $PY -m rayconv.tune "${COMMON[@]}" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  local rc=$?; t1=$(date +%s.%N)
  echo "$name $rc $($PY -c "print(f'{$t1 - $t0:.1f}')")" >> "$OUT/walls.txt"
  echo "$name: rc $rc, $(tail -1 "$OUT/$name.log")"
}
[ "$PACKED" = 1 ] && half packed "${PACK[@]}" --max-concurrent "$CONCURRENT"
[ "$SEQUENTIAL" = 1 ] && half sequential "${WHOLE[@]}" --max-concurrent 1
$PY benchmarks/tune_pack_report.py "$OUT"
