source .device/setup.sh
mkdir -p $OUT/alex3 $OUT/resnet3
cp /tmp/alex2/trace-alexnet-plan2-B1024.txt $OUT/ 2>/dev/null
timeout 220 python3 -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2 --global-batch-size 256,1024 --compile on --steps 30 --warmup 5 --no-anchors --out /tmp/alex3 > /tmp/alex3.log 2>&1; tr '\r' '\n' < /tmp/alex3.log | grep -E "RESULT|rror" | head; cp /tmp/alex3/bench.md /tmp/alex3/bench.parquet $OUT/alex3/
timeout 330 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,dp2 --global-batch-size 256 --compile on --steps 20 --warmup 4 --out /tmp/resnet3 > /tmp/resnet3.log 2>&1; tr '\r' '\n' < /tmp/resnet3.log | grep -E "RESULT|rror" | head; cp /tmp/resnet3/bench.md /tmp/resnet3/bench.parquet $OUT/resnet3/
tr '\r' '\n' < /tmp/alex3.log | grep -vE "logging.cc|^ +@" | tail -5 > $OUT/logs-tail.txt; tr '\r' '\n' < /tmp/resnet3.log | grep -vE "logging.cc|^ +@" | tail -8 >> $OUT/logs-tail.txt
