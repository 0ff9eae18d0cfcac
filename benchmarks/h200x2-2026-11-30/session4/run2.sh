source .device/setup.sh
timeout 170 python3 -m pytest -q -x --tb=short tests/test_gpu.py -k "pp2 or captured_sgd" > $OUT/gpu_tests_pp.txt 2>&1; tail -40 $OUT/gpu_tests_pp.txt | cut -c1-300
timeout 200 python3 -m rayconv.bench --models alexnet --layouts 1gpu --global-batch-size 256,1024 --steps 30 --warmup 5 --out $OUT/alex1 > $OUT/alex1.log 2>&1; tr '\r' '\n' < $OUT/alex1.log | grep -E "RESULT|rror" | head
timeout 200 python3 -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2 --global-batch-size 256,1024 --steps 30 --warmup 5 --trace 3 --no-anchors --out /tmp/alex2 > $OUT/alex2.log 2>&1; tr '\r' '\n' < $OUT/alex2.log | grep -E "RESULT|rror" | head
mkdir -p $OUT/alex2; cp /tmp/alex2/bench.* $OUT/alex2/; cp /tmp/alex2/trace-*plan2*.txt /tmp/alex2/trace-*dp2-B1024.txt $OUT/alex2/ 2>/dev/null; ls $OUT/alex2
