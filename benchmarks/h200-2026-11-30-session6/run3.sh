# Session 6, run 3 (nvidia-h200, one GPU): ResNet-50 compiled whole-model step at the global batch and
# its micro-batch sizes, each step replayed from a CUDA graph, and the bound they put on a balanced
# pp=2 1F1B pipeline (global 256..1024). (A first version timed without graphs: CPU-bound, discarded.)
source .device/setup.sh
timeout 200 python3 benchmarks/stage_times.py --model resnet50 --batch 1024 --bound --reps 20 2>&1 | tee $OUT/bound.txt | grep -E "WHOLE|BOUND|rror"
timeout 230 python3 benchmarks/stage_times.py --model resnet50 --batch 512 --microbatches 4 --cuts 8,9 --reps 20 2>&1 | tee $OUT/cuts.txt | grep -E "WHOLE|CUT|rror"
