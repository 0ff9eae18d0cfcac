# Session 6, run 4 (nvidia-h200, one GPU): compiled, graphed stage times of the ResNet-50 two-stage cuts
# at micro-batch 128 (run 3's cut section failed: an eager forward on the default stream broke the capture).
source .device/setup.sh
timeout 300 python3 benchmarks/stage_times.py --model resnet50 --batch 512 --microbatches 4 --cuts 8,9,7 --reps 20 2>&1 | tee $OUT/cuts.txt | grep -E "WHOLE|CUT|rror"
