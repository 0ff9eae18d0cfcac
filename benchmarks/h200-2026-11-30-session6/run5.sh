# Session 6, run 5 (nvidia-h200-x2, lent late in the session, ~680 s of device time left):
# (a) the GPU tests session 5 did not reach under the paired pipeline sends (GPipe with 4 micro-batches in
#     float64 against single-device SGD, the AlexNet bf16 pipeline training, the 64 MB crossing exchange);
# (b) ResNet-50 at global batch 512: one GPU, pp=2 1F1B and GPipe with 4 micro-batches (peak memory of the
#     two schedules, and the driver overhead column for a pipeline layout).
source .device/setup.sh
timeout 190 python3 -m pytest -q -rA --tb=short -p no:cacheprovider tests/test_gpu.py -k "gpipe or crossing or layout1" > $OUT/gpu-tests.txt 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu-tests.txt | cut -c1-250 | tail -8
mkdir -p $OUT/resnet-pp
timeout 260 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,pp2m4,pp2m4-gpipe --global-batch-size 512 --steps 20 --warmup 4 --no-anchors --out /tmp/rpp > /tmp/rpp.log 2>&1
echo "pp rc=$?"; tr '\r' '\n' < /tmp/rpp.log | grep -E "RESULT|rror" | head; cp /tmp/rpp/bench.md /tmp/rpp/bench.parquet $OUT/resnet-pp/; tail -c 3000 /tmp/rpp.log > $OUT/resnet-pp/log-tail.txt
cat $OUT/resnet-pp/bench.md
