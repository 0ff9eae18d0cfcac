#!/usr/bin/env bash
# Issue 33's one-GPU check: an actor killed (SIGKILL) mid-run under --elastic 1 continues on the same GPU
# from its last checkpoint; its final test accuracy and parameters against the uninterrupted run's.
#   bash benchmarks/elastic_kill.sh OUT [DATA_DIR]     # run from the repository root
# Both runs: resnet18 on Fashion-MNIST at 32 px, bf16, global batch 512, EPOCHS epochs (default 2),
# --checkpoint-every EVERY (default 100); the killed run loses its actor once checkpoints/step-EVERY exists.
set -uo pipefail
OUT=${1:?usage: elastic_kill.sh OUT [DATA_DIR]}
DATA=${2:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}; EPOCHS=${EPOCHS:-2}; EVERY=${EVERY:-100}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 32 --precision bf16 --global-batch-size 512
      --lr 0.4 --epochs "$EPOCHS" --checkpoint-every "$EVERY" --compile off --no-progress --address local)
$PY -m rayconv.run "${ARGS[@]}" --out "$OUT/straight" > "$OUT/straight.log" 2>&1
echo "straight: rc $? $(tail -1 "$OUT/straight.log")"
$PY -m rayconv.run "${ARGS[@]}" --elastic 1 --max-failures 1 --out "$OUT/killed" > "$OUT/killed.log" 2>&1 &
RUN=$!
while kill -0 $RUN 2>/dev/null && [ ! -d "$OUT/killed/checkpoints/step-$EVERY" ]; do sleep 0.5; done
sleep 1
ACTOR=$(pgrep -o -f 'ray::Actor')   # (the oldest: the actor itself, not a loader process it forked)
echo "killing actor pid ${ACTOR:-none} after checkpoints/step-$EVERY"
[ -n "$ACTOR" ] && kill -9 "$ACTOR"
wait $RUN
echo "killed: rc $? $(tail -1 "$OUT/killed.log")"
grep -E "recovering|layout|lost" "$OUT/killed.log" | head -5
$PY - "$OUT" <<'PY'
import json, sys, torch
out = sys.argv[1]
s = {k: json.load(open(f"{out}/{k}/summary.json")) for k in ("straight", "killed")}
a = torch.load(f"{out}/straight/model.pt", weights_only=True)
b = torch.load(f"{out}/killed/model.pt", weights_only=True)
diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
for k in ("straight", "killed"):
    print(f"{k}: test_accuracy {s[k]['test_accuracy']:.4f} failures_recovered {s[k].get('failures_recovered')} "
          f"layout_changes {s[k].get('layout_changes')} wall {s[k]['wall_time_s']:.1f} s")
print(f"largest parameter difference {diff:.3g}")
PY
