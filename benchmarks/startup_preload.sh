#!/usr/bin/env bash
# Start-up where rayconv starts Ray itself, with and without Ray's workers preloading the actor's first
# imports (`cluster.connect`'s `preload`, on PRELOAD_MIN_CORES cores or more), against the plain script,
# in REPEAT rounds of three commands each (plain, preload, no preload), so that the machine's drift
# falls on all three alike. "No preload" runs a copy of rayconv whose PRELOAD_MIN_CORES no machine
# reaches, from its folder ($OUT_DIR/nopreload: the command's own folder comes first on sys.path, and a
# local cluster's workers take the driver's folder and PYTHONPATH).
#   bash benchmarks/startup_preload.sh OUT_DIR [DATA_DIR]      # one GPU: resnet18, Fashion-MNIST, 64 px, bf16
set -uo pipefail
mkdir -p "${1:?usage: startup_preload.sh OUT_DIR [DATA_DIR]}"
OUT_DIR=$(realpath "$1"); DATA=$(realpath "${2:-/usr/share/datasets/fashion-mnist}")
PY=${PY:-python3}; REPEAT=${REPEAT:-3}
mkdir -p "$OUT_DIR/nopreload"
cp -r rayconv "$OUT_DIR/nopreload/"
sed -i 's/^PRELOAD_MIN_CORES = .*/PRELOAD_MIN_CORES = 1 << 30/' "$OUT_DIR/nopreload/rayconv/cluster/connect.py"
grep -q '^PRELOAD_MIN_CORES = 1 << 30' "$OUT_DIR/nopreload/rayconv/cluster/connect.py" || { echo "PRELOAD_MIN_CORES not found"; exit 1; }
(cd "$OUT_DIR/nopreload" && PYTHONPATH="$OUT_DIR/nopreload:${PYTHONPATH:-}" $PY -c "import rayconv.cluster.connect as c; assert c.PRELOAD_MIN_CORES > 1e6, c.__file__") \
  || { echo "the copy without the preload is not the rayconv imported"; exit 1; }
ANCHOR=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 64 --precision bf16 --device cuda
        --global-batch-size 512 --lr 0.4)
RAYCONV=(--model resnet18 --data fashion-mnist --data-dir "$DATA" --image-size 64 --precision bf16 --device cuda
         --dp 1 --global-batch-size 512 --lr 0.4 --compile off --steps 20 --address local --no-progress)
step0() { $PY -c "import json,sys; s=json.load(open(sys.argv[1]))['startup']; p=s['phases']; a=s.get('actor_process') or {}; print(p['first_step'], 's; ray', p['ray'], '; actor process started', a.get('process_started'), ', __init__', a.get('init'), ', warmed up', a.get('warmed_up'))" "$1"; }
for i in $(seq "$REPEAT"); do
  $PY benchmarks/first_step_anchor.py "${ANCHOR[@]}" 2>/dev/null | sed -n 's/^FIRST_STEP //p' > "$OUT_DIR/anchor-$i.json"
  echo "plain script $i: $($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['first_step_s'])" "$OUT_DIR/anchor-$i.json") s"
  for arm in preload nopreload; do
    rm -rf "$OUT_DIR/$arm-$i"
    where=$PWD; extra=(); [ "$arm" = nopreload ] && where=$OUT_DIR/nopreload && extra=(env "PYTHONPATH=$OUT_DIR/nopreload:${PYTHONPATH:-}")
    (cd "$where" && env -u RAY_ADDRESS "${extra[@]}" $PY -m rayconv.run "${RAYCONV[@]}" --out "$OUT_DIR/$arm-$i") > "$OUT_DIR/$arm-$i.log" 2>&1 \
      && echo "$arm $i: $(step0 "$OUT_DIR/$arm-$i/summary.json")"
  done
done
$PY - "$OUT_DIR" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
least = lambda vals: min(vals) if vals else None
plain = least([json.loads(p.read_text())["first_step_s"] for p in out.glob("anchor-*.json") if p.stat().st_size])
arms = {a: least([json.loads(p.read_text())["startup"]["phases"]["first_step"] for p in out.glob(f"{a}-*/summary.json")])
        for a in ("preload", "nopreload")}
print("RESULT step 0 from the command (least): plain script", plain, "; " + "; ".join(
    f"{a} {v:.2f} s (plain + {v - plain:.1f} s)" if v and plain else f"{a} n/a" for a, v in arms.items()))
PYEOF
