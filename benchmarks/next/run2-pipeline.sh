# Next GPU session, call 2 (nvidia-h200-x2): ResNet-50 at global batch 512, one invocation: one GPU, 1F1B and
# interleaved 1F1B (2 chunks per stage) with 4 micro-batches (the 1.5x target; bound 1.44x without interleaving,
# at most about 1.60x with 2 chunks, RESULTS.md session 6), and GPipe (peak memory against 1F1B). Rows are written as
# each layout ends; a layout whose step takes over 150 s (GPipe never finished on GPUs before) is stopped and
# noted in its row, and the next one runs.
source .device/setup.sh
mkdir -p $OUT/rpp
timeout 560 python3 -u -m rayconv.bench --models resnet50 --layouts 1gpu,pp2m4,pp2m4v2,pp2m4-gpipe --global-batch-size 512 --steps 20 --warmup 4 --no-anchors --call-timeout-s 150 --out /tmp/rpp > /tmp/rpp.log 2>&1
echo "rc=$?"; tr '\r' '\n' < /tmp/rpp.log | grep -E "RESULT|rror" | head; cp /tmp/rpp/bench.md /tmp/rpp/bench.parquet $OUT/rpp/ 2>/dev/null; tail -c 4000 /tmp/rpp.log > $OUT/rpp/log-tail.txt
cat $OUT/rpp/bench.md
