#!/usr/bin/env bash
# Issue 33's one-GPU check: an actor killed (SIGKILL) mid-run under --elastic 1 continues on the same GPU
# from its last checkpoint; its final test accuracy and parameters against the uninterrupted run's.
#   bash benchmarks/elastic_kill.sh OUT DATA_DIR       # one GPU: resnet18, Fashion-MNIST (idx .gz files) at 32 px
#   TINY=1 bash benchmarks/elastic_kill.sh OUT         # CPU: convnet on the digits, float64 (a check of the script)
# Run from the repository root. Both runs: the same command, EPOCHS epochs; the second gets --elastic 1 and
# loses its actor as soon as checkpoints/step-EVERY exists (EVERY well before the last step, so the kill
# lands mid-training; the script says where it landed). The last line sums it up: both final test
# accuracies, the largest parameter difference, the seconds lost and the steps redone.
set -uo pipefail
OUT=${1:?usage: elastic_kill.sh OUT [DATA_DIR]}
PY=${PY:-python3}
if [ "${TINY:-0}" = 1 ]; then
  EPOCHS=${EPOCHS:-6}; EVERY=${EVERY:-40}
  ARGS=(--model convnet --data digits --device cpu --dp 1 --precision fp64 --global-batch-size 64 --lr 0.05
        --loader-workers 0)
else
  DATA=${2:?usage: elastic_kill.sh OUT DATA_DIR (a folder holding the Fashion-MNIST idx .gz files)}
  EPOCHS=${EPOCHS:-10}; EVERY=${EVERY:-300}
  ARGS=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 32 --precision bf16
        --global-batch-size 512 --lr 0.4 --compile off)
fi
ARGS+=(--epochs "$EPOCHS" --checkpoint-every "$EVERY" --no-progress --address local)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

descendants() {   # every process under pid $1 (the run's own Ray: its raylet, workers and actors)
  local child
  for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done
}

$PY -m rayconv.run "${ARGS[@]}" --out "$OUT/straight" > "$OUT/straight.log" 2>&1
echo "straight: rc $? $(tail -1 "$OUT/straight.log")"
$PY -m rayconv.run "${ARGS[@]}" --elastic 1 --max-failures 1 --out "$OUT/killed" > "$OUT/killed.log" 2>&1 &
RUN=$!
while kill -0 $RUN 2>/dev/null && [ ! -d "$OUT/killed/checkpoints/step-$EVERY" ]; do sleep 0.1; done
ACTOR=""
for pid in $(descendants $RUN); do   # the actor itself, not a loader process it forked: the oldest match
  if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q '^ray::Actor'; then ACTOR=$pid; break; fi
done
echo "killing actor pid ${ACTOR:-none} once checkpoints/step-$EVERY exists"
[ -n "$ACTOR" ] && kill -9 "$ACTOR"
wait $RUN
echo "killed: rc $? $(tail -1 "$OUT/killed.log")"
grep -E "rayconv: (recovering|step [0-9]+: layout)" "$OUT/killed.log" | head -3
$PY - "$OUT" "$EVERY" <<'PY'
import json, sys, torch
out, every = sys.argv[1], int(sys.argv[2])
s = {k: json.load(open(f"{out}/{k}/summary.json")) for k in ("straight", "killed")}
a = torch.load(f"{out}/straight/model.pt", weights_only=True)
b = torch.load(f"{out}/killed/model.pt", weights_only=True)
diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
changes = s["killed"].get("layout_changes") or []
steps = s["straight"]["steps"]
if changes:
    c = changes[0]
    landed = f"the kill landed after step {c['step'] + c['steps_redone']} of {steps} ({c['from']} -> {c['to']})"
    lost = f"{c['seconds_lost']:.1f} s lost, {c['steps_redone']} steps redone"
else:
    landed, lost = f"NO LAYOUT CHANGE: the kill did not land mid-training (lower EVERY={every} or raise EPOCHS)", "n/a"
print(f"elastic_kill: straight test accuracy {s['straight']['test_accuracy']:.4f}, killed {s['killed']['test_accuracy']:.4f} "
      f"(largest parameter difference {diff:.3g}); {lost}; {landed}")
sys.exit(0 if changes else 1)
PY
