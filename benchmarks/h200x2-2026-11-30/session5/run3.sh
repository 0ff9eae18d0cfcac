# Session 5, run 3: pipeline sends paired with receives (comm.exchange, one NCCL group).
# (a) GPU tests of the pipeline layouts and the 64 MB crossing exchange (eager and graphed);
# (b) the unpaired pattern it replaces, expected to hang (killed after 35 s);
# (c) ResNet-50 pp=2 at global batch 512 (1F1B, 4 and 8 micro-batches) against one GPU;
# (d) AlexNet per-layer plan at global batch 1024 against one GPU.
source .device/setup.sh
timeout 200 python3 -m pytest -q -rA --tb=short -p no:cacheprovider tests/test_gpu.py -k "crossing or pp2 or layout1" > $OUT/gpu-tests-pp.txt 2>&1
echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu-tests-pp.txt | cut -c1-250 | tail -12
timeout 35 python3 -m torch.distributed.run --standalone --nproc_per_node=2 tests/nccl_crossing.py --unpaired > $OUT/unpaired.txt 2>&1
echo "unpaired rc=$? (124: still blocked after 35 s)"; grep -c UNPAIRED-DONE $OUT/unpaired.txt
mkdir -p $OUT/resnet-pp $OUT/alex
timeout 220 python3 -m rayconv.bench --models resnet50 --layouts 1gpu,pp2m4,pp2m8 --global-batch-size 512 --steps 20 --warmup 4 --no-anchors --out /tmp/rpp > /tmp/rpp.log 2>&1
echo "pp rc=$?"; tr '\r' '\n' < /tmp/rpp.log | grep -E "RESULT|rror" | head; cp /tmp/rpp/bench.md /tmp/rpp/bench.parquet $OUT/resnet-pp/
timeout 115 python3 -m rayconv.bench --models alexnet --layouts 1gpu,plan2 --global-batch-size 1024 --steps 30 --warmup 5 --no-anchors --out /tmp/alex > /tmp/alex.log 2>&1
echo "alex rc=$?"; tr '\r' '\n' < /tmp/alex.log | grep -E "RESULT|rror" | head; cp /tmp/alex/bench.md /tmp/alex/bench.parquet $OUT/alex/
