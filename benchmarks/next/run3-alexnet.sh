# Next GPU session, call 3 (nvidia-h200-x2): AlexNet at global batch 1024 (target 1.85x one GPU; the per-layer
# plan measured 1.82x in sessions 4 and 5). Data parallel under the defaults (compiled, graphed) was never measured
# at 1024; then the plan with NCCL's Simple protocol for its 25 MB buckets (actors inherit the driver's environment
# when the bench starts the local Ray).
source .device/setup.sh
mkdir -p $OUT/a $OUT/b
timeout 280 python3 -u -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2 --global-batch-size 1024 --steps 30 --warmup 5 --no-anchors --call-timeout-s 150 --out /tmp/a > /tmp/a.log 2>&1
echo "rc=$?"; tr '\r' '\n' < /tmp/a.log | grep -E "RESULT|rror" | head; cp /tmp/a/bench.md /tmp/a/bench.parquet $OUT/a/ 2>/dev/null
NCCL_PROTO=Simple timeout 280 python3 -u -m rayconv.bench --models alexnet --layouts 1gpu,plan2 --global-batch-size 1024 --steps 30 --warmup 5 --no-anchors --call-timeout-s 150 --out /tmp/b > /tmp/b.log 2>&1
echo "rc=$?"; tr '\r' '\n' < /tmp/b.log | grep -E "RESULT|rror" | head; cp /tmp/b/bench.md /tmp/b/bench.parquet $OUT/b/ 2>/dev/null
