#!/usr/bin/env bash
# docs/recipe.md's Fashion-MNIST command (128 px, 30 epochs) once per (variant, seed), one after another on
# one GPU, then each run's evaluations: step, epoch, train loss, test accuracy (and the moving average's).
#   bash benchmarks/recipe_seeds.sh OUT_DIR DATA_DIR "NAME=EXTRA FLAGS" ...   # SEEDS="0 1 2"
# a variant's extra flags follow the recipe's and so override them (e.g. "lr2=--lr 0.2").
set -uo pipefail
OUT_DIR=${1:?usage: recipe_seeds.sh OUT_DIR DATA_DIR NAME=FLAGS ...}; DATA=${2:?DATA_DIR}; shift 2
PY=${PY:-python3}; SEEDS=${SEEDS:-0}
PRECISE_BN=${PRECISE_BN-20}  # the recipe's --precise-bn-batches 20; PRECISE_BN= for none
BN_MOMENTUM=${BN_MOMENTUM:-}  # e.g. BN_MOMENTUM=0.01; default: the model's own
BN="${BN_MOMENTUM:+--bn-momentum $BN_MOMENTUM}${PRECISE_BN:+ --precise-bn-batches $PRECISE_BN}"
RECIPE="--data fashion-mnist --model resnet18 --image-size ${SIZE:-128} --epochs ${EPOCHS:-30} --global-batch-size 512
  --lr ${LR:-0.2} $BN --lr-warmup-epochs 2 --opt sgd_nesterov --label-smoothing 0.1 --norm-weight-decay 0 --bias-weight-decay 0
  --augment pad-crop --random-erase 0.5 --precision bf16 --compile off --target-accuracy 0.93"
mkdir -p "$OUT_DIR"
for variant in "$@"; do
  name=${variant%%=*}; extra=${variant#*=}
  for seed in $SEEDS; do
    echo "== $name seed $seed: $PY -m rayconv.run $(echo $RECIPE) $extra --seed $seed"
    $PY -u -m rayconv.run $RECIPE --data-dir "$DATA" $extra --seed "$seed" --no-progress --log-every 100000 \
      --out "$OUT_DIR/$name-s$seed" 2>&1 | tail -1
    $PY - "$OUT_DIR/$name-s$seed" "$name" "$seed" <<'PYEOF'
import json, sys
from pathlib import Path
import pyarrow.parquet as pq
out, name, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    s = json.loads((out / "summary.json").read_text())
except OSError as e:
    print(f"RUN {name} seed {seed}: no results ({e})"); sys.exit(0)
loss = None
evals = []
for r in rows:
    if r["kind"] == "train":
        loss = r["loss"]
    elif r["kind"] == "eval":
        evals.append(r)
        ema = r.get("ema_test_accuracy")
        print(f"  eval {name} s{seed} epoch {r['epoch']:2d} step {r['step']:4d} train_loss {loss:.4f} "
              f"test_acc {r['test_accuracy']:.4f}" + (f" ema {ema:.4f}" if ema is not None else ""))
ema = s.get("ema_test_accuracy")
print(f"RUN {name} seed {seed}: final test {s.get('test_accuracy')} ema {ema} "
      f"min_after_warmup {min(r['test_accuracy'] for r in (evals[2:] or evals)):.4f} "
      f"t93_since {s.get('time_to_target_since_s')} t93_train {s.get('time_to_target_train_s')} "
      f"images/s {s.get('images_per_s')}")
PYEOF
  done
done
