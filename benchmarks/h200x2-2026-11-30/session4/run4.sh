# run on the still-warm machine of run 3 (its Inductor cache made the 1gpu first step 3 s)
source .device/setup.sh
timeout 110 python3 -m rayconv.bench --models alexnet --layouts 1gpu,plan2 --global-batch-size 1024 --compile on --steps 30 --warmup 5 --no-anchors --out /tmp/alex4 > /tmp/alex4.log 2>&1; tr '\r' '\n' < /tmp/alex4.log | grep -E "RESULT|rror" | head; mkdir -p $OUT/alex4; cp /tmp/alex4/bench.md /tmp/alex4/bench.parquet $OUT/alex4/
