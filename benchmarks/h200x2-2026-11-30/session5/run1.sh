# Session 5, run 1: the intermittent pp2 1F1B eager failure (3 tries, NCCL warnings on), then the rest of test_gpu.py.
source .device/setup.sh
export NCCL_DEBUG=WARN
for i in 1 2 3; do
  timeout 60 python3 -m pytest -q -x --tb=long -p no:cacheprovider tests/test_gpu.py -k "pp2-1f1b-eager" > $OUT/pp-eager-$i.txt 2>&1
  echo "try $i rc=$?"; grep -E "passed|failed|Error|error" $OUT/pp-eager-$i.txt | tail -3 | cut -c1-250
done
timeout 390 python3 -m pytest -q -rA --tb=short --durations=0 -p no:cacheprovider tests/test_gpu.py -k "bf16 or plan or fs2 or dp2-eager" > $OUT/gpu-tests.txt 2>&1
echo "rest rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|ALEXNET" $OUT/gpu-tests.txt | cut -c1-250 | tail -40
