source .device/setup.sh
timeout 150 python3 -m pytest -x -q tests/test_gpu.py -k "pp2-1f1b or graphs" --tb=short -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|Error|assert" $OUT/gpu_tests.txt | tail -15
timeout 400 python3 -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2 --global-batch-size 256,1024 --compile on --cuda-graphs on --steps 30 --warmup 5 --out $OUT/alex > $OUT/alex.log 2>&1; tr '\r' '\n' < $OUT/alex.log | grep -E "RESULT|rror" | head -20
