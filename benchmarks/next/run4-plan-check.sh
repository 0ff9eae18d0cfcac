# Next GPU session, call 4 (nvidia-h200-x2; carry [".device"]; `timeout 590 bash benchmarks/next/run4-plan-check.sh`).
# The planner (issue 16) against measurement: python -m rayconv.plan measures layer times on one H200 and the
# links between two actors, ranks the layouts; the bench then measures the top 3 and 1gpu; plan_check.md has
# predicted beside measured images/s, rank and peak GiB. Then the predictions for 4 and 8 GPUs and 2 hosts of 8
# from the same (cached) measurements. ResNet-50 (its compile takes 40-70 s a layout) is call 5: the same with
# --model resnet50 --global-batch-size 512.
source .device/setup.sh
export RAYCONV_CACHE_DIR=$OUT/cache
timeout 500 python3 -u benchmarks/plan_check.py --model alexnet --global-batch-size 256 --top 3 --steps 20 --warmup 5 \
  --call-timeout-s 120 --out $OUT/alexnet-B256 > $OUT/plan-check-alexnet.log 2>&1
echo "rc=$?"; cat $OUT/alexnet-B256/plan_check.md 2>/dev/null
timeout 60 python3 -u -m rayconv.plan --model alexnet --global-batch-size 256 --machine all --top 8 > $OUT/machines-alexnet.txt 2>&1
echo "rc=$?"; head -40 $OUT/machines-alexnet.txt
