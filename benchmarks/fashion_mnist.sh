#!/usr/bin/env bash
# Fashion-MNIST to its published accuracy on one GPU, against the plain-PyTorch anchor in the same call:
#   bash benchmarks/fashion_mnist.sh OUT_DIR [DATA_DIR]
# rows: OUT_DIR/anchor.json (eager and compiled), OUT_DIR/rayconv/summary.json, OUT_DIR/synthetic/bench.parquet
set -uo pipefail  # each part runs even when one before it failed
OUT_DIR=${1:?usage: fashion_mnist.sh OUT_DIR [DATA_DIR]}
DATA=${2:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}
SIZE=${SIZE:-128}; EPOCHS=${EPOCHS:-30}; BATCH=${BATCH:-512}; LR=${LR:-0.4}; ERASE=${ERASE:-0.5}
COMPILE=${COMPILE:-off}  # rayconv's --compile: off reaches the target sooner (no compile of the step or the evaluation)
mkdir -p "$OUT_DIR"
# the recipe, in rayconv's flags (the anchor takes the same names)
RECIPE="--image-size $SIZE --epochs $EPOCHS --global-batch-size $BATCH --lr $LR --lr-warmup-epochs 2
  --lr-warmup-decay 0.01 --label-smoothing 0.1 --weight-decay 5e-4 --norm-weight-decay 0 --random-erase $ERASE
  --target-accuracy 0.93"
echo "== anchor: $PY -m rayconv.bench.accuracy_anchor --data-dir $DATA $RECIPE --compile both"
$PY -u -m rayconv.bench.accuracy_anchor --data-dir "$DATA" $RECIPE --compile both --out "$OUT_DIR/anchor.json" \
  2>&1 | grep -v "^anchor .* epoch" | tail -4
echo "== rayconv: $PY -m rayconv.run --data fashion-mnist --model resnet18 $RECIPE --opt sgd_nesterov --bias-weight-decay 0 --augment pad-crop --precision bf16 --compile $COMPILE"
$PY -u -m rayconv.run --data fashion-mnist --data-dir "$DATA" --model resnet18 $RECIPE --opt sgd_nesterov \
  --bias-weight-decay 0 --augment pad-crop --precision bf16 --compile "$COMPILE" --no-progress --log-every 1000 \
  --out "$OUT_DIR/rayconv" 2>&1 | tail -4
echo "== synthetic: $PY -m rayconv.bench --models resnet18 --image-size $SIZE --global-batch-size $BATCH --layouts 1gpu --precision bf16 --compile $COMPILE"
$PY -u -m rayconv.bench --device cuda --models resnet18 --image-size "$SIZE" --global-batch-size "$BATCH" \
  --layouts 1gpu --precision bf16 --compile "$COMPILE" --steps 200 --warmup 20 --no-anchors --out "$OUT_DIR/synthetic" 2>&1 | tail -3
