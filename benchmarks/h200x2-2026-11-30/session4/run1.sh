source .device/setup.sh
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 90 python3 -m pytest -q -x --tb=short tests/test_gpu.py -k "dropout_and_learning_rate" > $OUT/smoke.txt 2>&1; tail -25 $OUT/smoke.txt
timeout 200 python3 -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2 --global-batch-size 256 --steps 30 --warmup 5 --trace 3 --no-anchors --out $OUT/alex > $OUT/alex.log 2>&1; tr '\r' '\n' < $OUT/alex.log | grep -E "RESULT|rror" | head -20
timeout 250 python3 -m pytest -q --tb=short tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; tail -30 $OUT/gpu_tests.txt
