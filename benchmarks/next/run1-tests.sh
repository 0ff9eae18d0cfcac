# Next GPU session, call 1 (nvidia-h200-x2; carry [".device"]; `timeout 590 bash benchmarks/next/run1-tests.sh`).
# The GPU tests session 6 could not run, unbuffered (python3 -u) so that a killed run still shows how far it got:
# GPipe with graphs and eagerly (it never finished in sessions 5 and 6; session 7 found the likely cause, a
# round batch NCCL cannot complete, and split it: this confirms or refutes that), the default single
# micro-batch pipeline (the same split), interleaved 1F1B against single-device SGD (float64, graphs and
# eager), the 64 MB crossing exchange, the AlexNet bf16 pipeline training.
source .device/setup.sh
for k in "gpipe-4-eager" "gpipe-4 and not eager" "one-microbatch" "interleaved" "crossing" "layout1"; do
  echo "== -k $k"
  timeout 150 python3 -u -m pytest -q -rA --tb=short -p no:cacheprovider tests/test_gpu.py -k "$k" 2>&1 | tee -a $OUT/gpu-tests.txt | grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" | cut -c1-200
  echo "rc=${PIPESTATUS[0]}"
done
