source .device/setup.sh
nvidia-smi topo -m > $OUT/topo.txt 2>&1
(NCCL_DEBUG=INFO timeout 60 torchrun --standalone --nproc_per_node=2 benchmarks/nccl_bw.py 2>&1 | grep -E "^NCCL |via|NCCL version|comm 0x|Error|error" | head -40) > $OUT/nccl.txt
(NCCL_DEBUG=INFO timeout 70 python3 benchmarks/nccl_bw.py --ray 2>&1 | grep -E "^NCCL |via|Error|error" | head -40) >> $OUT/nccl.txt
(timeout 60 python3 benchmarks/nccl_bw.py --ray --one-gpu-visible 2>&1 | grep -E "^NCCL |Error|error" | head -20) >> $OUT/nccl.txt
cat $OUT/nccl.txt | grep "^NCCL "
timeout 170 python3 -m pytest -q -x tests/test_gpu.py > $OUT/gpu_tests.txt 2>&1; tail -5 $OUT/gpu_tests.txt
timeout 220 python3 -m rayconv.bench --models alexnet --layouts 1gpu,dp2,plan2,fs2 --global-batch-size 256,1024 --steps 20 --warmup 4 --trace 3 --out $OUT/alex > $OUT/alex.log 2>&1; tr '\r' '\n' < $OUT/alex.log | grep -E "RESULT|rror" | head
