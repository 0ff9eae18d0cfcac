# Session 6, run 1 (nvidia-h200, one GPU: 2-GPU kinds were withheld this session).
# Driver overhead (bench column driver_overhead) and rayconv on 1 GPU vs plain PyTorch, both models.
source .device/setup.sh
mkdir -p $OUT/alex $OUT/resnet
timeout 200 python3 -m rayconv.bench --models alexnet --layouts 1gpu --global-batch-size 256,1024 --steps 30 --warmup 5 --out /tmp/alex > /tmp/alex.log 2>&1
echo "alex rc=$?"; tr '\r' '\n' < /tmp/alex.log | grep -E "RESULT|rror" | head; cp /tmp/alex/bench.md /tmp/alex/bench.parquet $OUT/alex/; tail -c 3000 /tmp/alex.log > $OUT/alex/log-tail.txt
timeout 330 python3 -m rayconv.bench --models resnet50 --layouts 1gpu --global-batch-size 256 --steps 20 --warmup 4 --out /tmp/rn > /tmp/rn.log 2>&1
echo "resnet rc=$?"; tr '\r' '\n' < /tmp/rn.log | grep -E "RESULT|rror" | head; cp /tmp/rn/bench.md /tmp/rn/bench.parquet $OUT/resnet/; tail -c 3000 /tmp/rn.log > $OUT/resnet/log-tail.txt
cat $OUT/alex/bench.md $OUT/resnet/bench.md
