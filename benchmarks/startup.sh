#!/usr/bin/env bash
# Start-up: seconds from the command to step 0 done, rayconv against the plain script
# (benchmarks/first_step_anchor.py: same model, data, image size and precision), in one call:
#   bash benchmarks/startup.sh gpu OUT_DIR [DATA_DIR]   # one GPU: resnet18 on Fashion-MNIST at 64 px, bf16
#   bash benchmarks/startup.sh cpu OUT_DIR              # CPU: the digits main job's ConvNet
# Each is run REPEAT times (default 3), in turn; the least of each is compared. rayconv runs on a cluster
# started here (`ray start --head` on its own ports and temp dir, ended by its processes' ids), then
# (SELF=1, default) REPEAT more times starting Ray itself. On the running cluster each command after the
# first reuses the actors the one before kept (--keep-actors-s); NEW=1 keeps none, so that every command
# starts its actors as a first command does. rayconv's figure is summary.json's
# startup.phases.first_step; each run's slowest phase is printed beside it.
set -uo pipefail
MODE=${1:?usage: startup.sh gpu|cpu OUT_DIR [DATA_DIR]}
OUT_DIR=${2:?usage: startup.sh gpu|cpu OUT_DIR [DATA_DIR]}
DATA=${3:-/usr/share/datasets/fashion-mnist}
PY=${PY:-python3}; REPEAT=${REPEAT:-3}; SELF=${SELF:-1}; STEPS=${STEPS:-20}; COMPILE=${COMPILE:-off}; NEW=${NEW:-0}
KEEP=(); [ "$NEW" = 1 ] && KEEP=(--keep-actors-s 0)
PORT=${PORT:-6390}
mkdir -p "$OUT_DIR"
if [ "$MODE" = gpu ]; then
  ANCHOR=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 64 --precision bf16 --device cuda
          --global-batch-size 512 --lr 0.4)
  RAYCONV=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 64 --precision bf16 --device cuda
           --dp 1 --global-batch-size 512 --lr 0.4 --compile "$COMPILE" --steps "$STEPS")
  CPUS=$(nproc)
else
  ANCHOR=(--device cpu)
  RAYCONV=(--device cpu --steps 5)
  CPUS=2
fi
source "$(dirname "$0")/ray_head.sh"
start_head "$PORT" "$OUT_DIR/ray_start.log" --num-cpus "$CPUS" || exit 1

first_step() {  # summary.json's first_step, how Ray was reached, the slowest phase; then the whole record
  $PY -c "import json,sys; s=json.load(open(sys.argv[1]))['startup']; print(s['phases']['first_step'], 's; Ray', s['ray'] + '; slowest', s['slowest']['phase'], s['slowest']['s']); print('  startup', json.dumps({k: s.get(k) for k in ('phases', 'actor_setup_s', 'actor_process')}))" "$1"
}
for i in $(seq "$REPEAT"); do
  $PY benchmarks/first_step_anchor.py "${ANCHOR[@]}" 2>/dev/null | sed -n 's/^FIRST_STEP //p' > "$OUT_DIR/anchor-$i.json"
  echo "plain script $i: $($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['first_step_s'])" "$OUT_DIR/anchor-$i.json") s"
  rm -rf "$OUT_DIR/cluster-$i"
  RAY_ADDRESS=127.0.0.1:$PORT $PY -m rayconv.run "${RAYCONV[@]}" "${KEEP[@]}" --no-progress --out "$OUT_DIR/cluster-$i" \
    > "$OUT_DIR/cluster-$i.log" 2>&1 && echo "rayconv on the running cluster $i: $(first_step "$OUT_DIR/cluster-$i/summary.json")"
done
stop_head
if [ "$SELF" = 1 ]; then
  for i in $(seq "$REPEAT"); do
    rm -rf "$OUT_DIR/self-$i"
    # (--address local: a new local cluster, also where another one runs on this machine)
    env -u RAY_ADDRESS $PY -m rayconv.run "${RAYCONV[@]}" --address local --no-progress --out "$OUT_DIR/self-$i" \
      > "$OUT_DIR/self-$i.log" 2>&1 && echo "rayconv starting Ray itself $i: $(first_step "$OUT_DIR/self-$i/summary.json")"
  done
fi
$PY - "$OUT_DIR" "$REPEAT" <<'EOF'
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
def least(pattern, key):
    vals = [key(p) for p in (out.glob(pattern)) if p.stat().st_size]
    return min(vals) if vals else None
plain = least("anchor-*.json", lambda p: json.loads(p.read_text())["first_step_s"])
step0 = lambda p: json.loads(p.read_text())["startup"]["phases"]["first_step"]
cluster, own = least("cluster-*/summary.json", step0), least("self-*/summary.json", step0)
fmt = lambda v: "n/a" if v is None else f"{v:.2f} s"
print(f"RESULT step 0 from the command (least of {n}): plain script {fmt(plain)}; rayconv on a running cluster "
      f"{fmt(cluster)}" + (f" ({cluster / plain:.2f}x)" if plain and cluster else "")
      + f"; rayconv starting Ray {fmt(own)}" + (f" (plain + {own - plain:.1f} s)" if plain and own else ""))
EOF
