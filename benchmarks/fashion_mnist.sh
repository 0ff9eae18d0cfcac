#!/usr/bin/env bash
# Fashion-MNIST to its published accuracy on one GPU, against the plain-PyTorch anchor in the same call:
#   bash benchmarks/fashion_mnist.sh OUT_DIR [DATA_DIR]
# rows: OUT_DIR/anchor.json (eager and compiled), OUT_DIR/rayconv/summary.json, OUT_DIR/synthetic/bench.parquet
# (SYNTHETIC=0 leaves the synthetic row out); the last line compares the time to --target-accuracy from
# each command (rayconv's summary.json time_to_target_since_s; the anchor's, per mode, as though run alone).
# RUNNING=1: rayconv runs on a Ray cluster started here first (`ray start --head` on its own ports and temp
# dir, ended by its processes' ids), as a user who ran `ray start` before; default: rayconv starts Ray itself.
# WARM=1 (with RUNNING=1): a short rayconv command (the same model, data and batch, 5 steps) runs on that
# cluster first, so that the timed command finds the actors it kept (--keep-actors-s), as a user's second
# command there does.
set -uo pipefail  # each part runs even when one before it failed
OUT_DIR=${1:?usage: fashion_mnist.sh OUT_DIR [DATA_DIR]}
DATA=${2:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}
SIZE=${SIZE:-128}; EPOCHS=${EPOCHS:-30}; BATCH=${BATCH:-512}; LR=${LR:-0.2}; ERASE=${ERASE:-0.5}
BN_MOMENTUM=${BN_MOMENTUM:-}; BN=${BN_MOMENTUM:+--bn-momentum $BN_MOMENTUM}  # e.g. BN_MOMENTUM=0.01; default: the model's own
PRECISE_BN=${PRECISE_BN-20}; BN="$BN${PRECISE_BN:+ --precise-bn-batches $PRECISE_BN}"  # the recipe's 20; PRECISE_BN= for none
ANCHOR_COMPILE=${ANCHOR_COMPILE:-both}  # the anchor's modes: off (eager), on (compiled) or both; eager reaches the target sooner
COMPILE=${COMPILE:-off}  # rayconv's --compile: off reaches the target sooner (no compile of the step or the evaluation)
mkdir -p "$OUT_DIR"
# the recipe, in rayconv's flags (the anchor takes the same names)
RECIPE="--image-size $SIZE --epochs $EPOCHS --global-batch-size $BATCH --lr $LR --lr-warmup-epochs 2
  --lr-warmup-decay 0.01 --label-smoothing 0.1 --weight-decay 5e-4 --norm-weight-decay 0 --random-erase $ERASE
  $BN --target-accuracy 0.93"
echo "== anchor: $PY -m rayconv.bench.accuracy_anchor --data-dir $DATA $RECIPE --compile $ANCHOR_COMPILE"
$PY -u -m rayconv.bench.accuracy_anchor --data-dir "$DATA" $RECIPE --compile "$ANCHOR_COMPILE" --out "$OUT_DIR/anchor.json" \
  2>&1 | grep -v "^anchor .* epoch" | tail -4
ADDRESS=(--address local)
if [ "${RUNNING:-0}" = 1 ]; then
  PORT=${PORT:-6391}
  source "$(dirname "$0")/ray_head.sh"
  start_head "$PORT" "$OUT_DIR/ray_start.log" || exit 1   # (the anchor has run: its anchor.json stays)
  ADDRESS=(--address "127.0.0.1:$PORT")
fi
if [ "${WARM:-0}" = 1 ] && [ "${RUNNING:-0}" = 1 ]; then
  echo "== a first command on the cluster (its actors kept for the timed one): --steps 5"
  $PY -u -m rayconv.run --data fashion-mnist --data-dir "$DATA" --model resnet18 --image-size "$SIZE" \
    --global-batch-size "$BATCH" --steps 5 --precision bf16 --compile "$COMPILE" --no-progress \
    "${ADDRESS[@]}" --out "$OUT_DIR/first" 2>&1 | tail -2
fi
echo "== rayconv (${ADDRESS[*]}): $PY -m rayconv.run --data fashion-mnist --model resnet18 $RECIPE --opt sgd_nesterov --bias-weight-decay 0 --augment pad-crop --precision bf16 --compile $COMPILE"
$PY -u -m rayconv.run --data fashion-mnist --data-dir "$DATA" --model resnet18 $RECIPE --opt sgd_nesterov \
  --bias-weight-decay 0 --augment pad-crop --precision bf16 --compile "$COMPILE" --no-progress --log-every 1000 \
  "${ADDRESS[@]}" --out "$OUT_DIR/rayconv" 2>&1 | tail -4
$PY - "$OUT_DIR" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
r = json.loads((out / "rayconv" / "summary.json").read_text())
a = {x["mode"]: x for x in json.loads((out / "anchor.json").read_text())["runs"]}
ours = r.get("time_to_target_since_s")
for mode, x in a.items():
    theirs = x.get("time_to_target_since_s")
    ratio = f"{ours / theirs:.2f}x" if ours and theirs else "n/a"
    print(f"FROM_COMMAND rayconv {ours} s (train {r.get('time_to_target_train_s')} s, final {r.get('test_accuracy')}) "
          f"vs anchor {mode} {theirs} s (train {x.get('time_to_target_train_s')} s, final {x.get('final_test_accuracy')}): {ratio}")
PYEOF
[ "${SYNTHETIC:-1}" = 0 ] && exit 0
echo "== synthetic: $PY -m rayconv.bench --models resnet18 --image-size $SIZE --global-batch-size $BATCH --layouts 1gpu --precision bf16 --compile $COMPILE"
$PY -u -m rayconv.bench --device cuda --models resnet18 --image-size "$SIZE" --global-batch-size "$BATCH" \
  --layouts 1gpu --precision bf16 --compile "$COMPILE" --steps 200 --warmup 20 --no-anchors --out "$OUT_DIR/synthetic" 2>&1 | tail -3
