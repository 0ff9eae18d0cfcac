source .device/setup.sh
timeout 210 python3 -m rayconv.bench --models alexnet --layouts 1gpu --global-batch-size 256,1024 --steps 30 --warmup 5 --out $OUT/alex > $OUT/alex.log 2>&1; tr '\r' '\n' < $OUT/alex.log | grep -E "RESULT|rror" | head -20
timeout 330 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,dp2 --global-batch-size 256 --steps 20 --warmup 4 --out $OUT/resnet > $OUT/resnet.log 2>&1; tr '\r' '\n' < $OUT/resnet.log | grep -E "RESULT|rror" | head -20
