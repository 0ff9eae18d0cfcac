# Session 5, run 2: ResNet-50 under the defaults (compiled, whole-step CUDA graphs).
# (a) dp=2 against torchrun DDP at global batch 256, anchors in the same invocation;
# (b) pp=2 at global batch 512: 1F1B with 4 and 8 micro-batches, GPipe with 8 (peak memory), against one GPU.
source .device/setup.sh
mkdir -p $OUT/resnet-dp $OUT/resnet-pp
timeout 320 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,dp2 --global-batch-size 256 --steps 20 --warmup 4 --out /tmp/rdp > /tmp/rdp.log 2>&1
echo "dp rc=$?"; tr '\r' '\n' < /tmp/rdp.log | grep -E "RESULT|rror" | head; cp /tmp/rdp/bench.md /tmp/rdp/bench.parquet $OUT/resnet-dp/
timeout 255 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,pp2m4,pp2m8,pp2m8-gpipe --global-batch-size 512 --steps 20 --warmup 4 --no-anchors --out /tmp/rpp > /tmp/rpp.log 2>&1
echo "pp rc=$?"; tr '\r' '\n' < /tmp/rpp.log | grep -E "RESULT|rror" | head; cp /tmp/rpp/bench.md /tmp/rpp/bench.parquet $OUT/resnet-pp/
tr '\r' '\n' < /tmp/rdp.log | grep -vE "logging.cc|^ +@" | tail -6 > $OUT/logs-tail.txt; tr '\r' '\n' < /tmp/rpp.log | grep -vE "logging.cc|^ +@" | tail -10 >> $OUT/logs-tail.txt
