# Session 6, run 2 (nvidia-h200, one GPU): compiled stage times of the ResNet-50 two-stage cuts at
# micro-batch 128 (global batch 512, 4 micro-batches), and the 1F1B step they predict; then AlexNet
# on one GPU at global batch 1024 (driver overhead), cut from run 1 by its time limit.
source .device/setup.sh
timeout 380 python3 benchmarks/stage_times.py --model resnet50 --batch 512 --microbatches 4 2>&1 | tee $OUT/stage-times.txt | grep -E "WHOLE|CUT|rror"
echo "stage_times rc=${PIPESTATUS[0]}"
mkdir -p $OUT/alex
timeout 150 python3 -m rayconv.bench --models alexnet --layouts 1gpu --global-batch-size 1024 --steps 30 --warmup 5 --no-anchors --out /tmp/alex > /tmp/alex.log 2>&1
echo "alex rc=$?"; tr '\r' '\n' < /tmp/alex.log | grep -E "RESULT|rror" | head; cp /tmp/alex/bench.md /tmp/alex/bench.parquet $OUT/alex/
cat $OUT/alex/bench.md
