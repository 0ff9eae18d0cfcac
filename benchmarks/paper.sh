#!/usr/bin/env bash
# The measurements behind benchmarks/RESULTS.md (Yadan et al. 2013's questions RQ1-RQ5 and Figure 1),
# in parts that each fit in one 10-minute call on an H200 machine:
#
#   bash benchmarks/paper.sh PART [PART ...]      # run from the repository root
#
# PART (each needs the GPUs named; on fewer it prints "skipped" and goes on):
#   speed        RQ1-RQ3 baseline: rayconv on 1 GPU against plain PyTorch, AlexNet and ResNet-50,
#                global batch 256                                                       (1 GPU,  ~4 min)
#   batch        RQ4: images/s and peak memory over per-GPU batch 16..512, 1 GPU (and dp2 on 2+ GPUs),
#                eager steps under CUDA graphs (compiling each batch size would cost ~1 min each) (~3 min)
#   convergence  RQ4: test error against time on the digits for global batch 16..512, 1 GPU  (~3 min)
#   memory       RQ5: the largest per-GPU batch that trains, doubling from 512 until out of memory,
#                1 GPU (and dp2, fs2, pp2 on 2+ GPUs)                                          (~3 min)
#   curve        Figure 1: test error against time on the digits, 1 GPU and the 2-GPU layouts
#   input        Figure 1 through the image-folder input pipeline: the digits written as 64x64 PNG
#                files (benchmarks/report.py digits-folder), decoded and augmented by the real loader
#   dp-mp        RQ1: data against model parallelism on 2 GPUs, AlexNet (dp2, fs2, pp2m4, plan2) and
#                the two-column AlexNet 2012 (fs2), with the torchrun DDP anchor             (2 GPUs)
#   dp-mp-resnet RQ1 for ResNet-50: dp2, fs2, pp2m4                                          (2 GPUs)
#   mp-overlap   model parallelism with overlapped exchanges, each against rayconv on 1 GPU in the same
#                call: AlexNet fs2 and fs2 with 2, 4, 8 pieces per gather (exposed exchange time in
#                each row), the two-column AlexNet 2012 likewise, AlexNet's per-layer plan at 1024 (2 GPUs)
#   pp-bound     ResNet-50 pipelines at global batch 512: 1F1B and interleaved 1F1B at 4 and 8
#                micro-batches, GPipe at 4, with a torch.profiler table per layout (--trace) (2 GPUs)
#   hybrid       RQ2: AlexNet dp4, fs4, dp2xfs2, dp2xpp2m4, plan4; ResNet-50 dp4, dp2xpp2m4   (4 GPUs)
#   scale        RQ3: AlexNet dp8, dp4xfs2, plan8; ResNet-50 dp8, dp4xpp2m4                    (8 GPUs)
#   real         issue 15's input figures: ResNet-50 (1 GPU, and dp2 on 2+ GPUs) on synthetic tensors and on
#                generated ImageNet-size JPEG files prepared as shards, decoded on the CPU and on the GPU,
#                in one part so that the ratios hold; then input_bench.py's decode rates        (~6 min)
#   plan         issue 16's planner against measurement: benchmarks/plan_check.py for AlexNet at global
#                batch 256, then the predicted tables of 4 and 8 GPUs and 2 hosts of 8       (~4 min)
#   report       tables and figures of every part already run (needs no GPU): report.md, batch.png, memory.png
#   all          every part above that the machine's GPUs allow, then report
#
# Results go to $RESULTS/<machine>-<date>-<commit>/<part>/ (RESULTS default benchmarks/results; machine
# as nvidia-smi names it, e.g. h200x1, h200x2; cpu without GPUs). RUN_DIR=... names that folder instead
# (e.g. to add parts to an earlier run). Raw rows are Parquet, figures PNG; all parts append to its log.txt.
# Each bench call is stopped after PART_TIMEOUT seconds (default 290 on GPUs, 1200 on CPU); rows measured
# by then are kept.
# On one H200 with two 10-minute calls: `speed batch` in the first, `memory convergence curve input` in
# the second (RESULTS=$OUT to get the folder back: at most 7 files a call), then `report` on any machine.
#
# Without GPUs (or with DEVICE=cpu) every part runs as a smoke check of the script on CPU actors: the
# small ConvNet on 32x32 synthetic images, few steps, no timing worth reading; GPUS=N pretends N devices
# (CPU actors) so that the multi-GPU parts run too. PYTHON picks the interpreter (default python3).
set -euo pipefail

PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ! -f rayconv/bench/__main__.py ]]; then echo "paper.sh: run it from the repository root" >&2; exit 2; fi
PARTS=(speed batch convergence memory curve input real plan dp-mp dp-mp-resnet mp-overlap pp-bound hybrid scale
       report)
if [[ $# -eq 0 ]]; then sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 2; fi
todo=()
for p in "$@"; do
  if [[ $p == all ]]; then todo+=("${PARTS[@]}")
  elif [[ " ${PARTS[*]} " == *" $p "* ]]; then todo+=("$p")
  else echo "paper.sh: unknown part '$p': use one or more of ${PARTS[*]} all" >&2; exit 2
  fi
done

if [[ ${DEVICE:-auto} != cpu ]] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=cuda
  GPUS=${GPUS:-$(nvidia-smi -L | wc -l)}
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/nvidia//; s/[^a-z0-9]//g')
  MACHINE="${GPU_NAME}x${GPUS}"
else
  DEVICE=cpu
  GPUS=${GPUS:-2}
  MACHINE=cpu
fi
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RUN_DIR=${RUN_DIR:-${RESULTS:-benchmarks/results}/${MACHINE}-$(date -u +%F)-${COMMIT}}
mkdir -p "$RUN_DIR"

if [[ $DEVICE == cuda ]]; then
  ALEX=alexnet; RESNET=resnet50; ALEX2012=alexnet2012
  SIZE=(--image-size 224); STEPS=(--steps 20 --warmup 5); SWEEP_STEPS=(--steps 12)
  BATCH=256; SWEEP=(--min-batch 16 --max-batch 512); MEM=(--min-batch 512); EPOCHS=10; FOLDER_SIZE=64
else  # smoke check: the script end to end, in seconds per layout
  ALEX=convnet; RESNET=convnet_bn; ALEX2012=convnet2col
  SIZE=(--image-size 32); STEPS=(--steps 2 --warmup 1); SWEEP_STEPS=(--steps 3)
  BATCH=32; SWEEP=(--min-batch 16 --max-batch 32); MEM=(--min-batch 16 --max-batch 32); EPOCHS=1; FOLDER_SIZE=32
fi
COMMON=(--device "$DEVICE" --precision bf16)
PART_TIMEOUT=${PART_TIMEOUT:-$([[ $DEVICE == cuda ]] && echo 290 || echo 1200)}

log() { echo "paper.sh: $*" >&2; }

bench() {  # bench PART ARGS...: python -m rayconv.bench into $RUN_DIR/PART, its log beside the rows
  local part=$1; shift
  mkdir -p "$RUN_DIR/$part"
  log "$part: python -m rayconv.bench $* --out $RUN_DIR/$part"
  echo "== $part: python -m rayconv.bench $* --out $RUN_DIR/$part" >> "$RUN_DIR/log.txt"
  { timeout "$PART_TIMEOUT" "$PY" -u -m rayconv.bench "$@" --out "$RUN_DIR/$part" 2>&1 \
      || echo "paper.sh: $part: bench exit status $? (124: stopped after $PART_TIMEOUT s; rows so far kept)"; } \
    | sed -u 's/\r/\n/g; /^\s*$/d' | tee -a "$RUN_DIR/log.txt" \
    | grep --line-buffered -E '^(RESULT|SWEEP|CURVE|results in|paper.sh)|rror' || true
  rm -rf "$RUN_DIR/$part"/curve-*/  # the curve's training runs (their rows are in curve.parquet)
}

needs() {  # needs N PART: whether this machine has N GPUs (else says the part is skipped)
  if (( GPUS < $1 )); then log "$2: skipped (needs $1 GPUs; this machine has $GPUS)"; return 1; fi
}

part_speed() {
  bench speed "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX,$RESNET" --layouts 1gpu \
    --global-batch-size "$BATCH"
}
part_batch() {
  local lay=1gpu; (( GPUS >= 2 )) && lay=1gpu,dp2
  bench batch "${COMMON[@]}" "${SIZE[@]}" "${SWEEP_STEPS[@]}" --models "$ALEX,$RESNET" --layouts "$lay" \
    --sweep batch "${SWEEP[@]}" --compile off --no-anchors
}
part_convergence() {
  local batches=16,32,64,128,256,512; [[ $DEVICE == cpu ]] && batches=64,256
  bench convergence --device "$DEVICE" --curve --layouts 1gpu --global-batch-size "$batches" \
    --curve-epochs "$EPOCHS" --compile off
}
part_memory() {
  local lay=1gpu; (( GPUS >= 2 )) && lay=1gpu,dp2,fs2,pp2m4
  bench memory "${COMMON[@]}" "${SIZE[@]}" "${SWEEP_STEPS[@]}" --models "$ALEX,$RESNET" --layouts "$lay" \
    --sweep memory "${MEM[@]}" --compile off --no-anchors
}
part_curve() {
  local lay=1gpu; (( GPUS >= 2 )) && lay=1gpu,dp2,fs2,pp2m4,plan2
  bench curve --device "$DEVICE" --curve --layouts "$lay" --curve-epochs "$EPOCHS" --compile off
}
part_input() {
  local folder=${TMPDIR:-/tmp}/rayconv-digits-$FOLDER_SIZE lay=1gpu
  (( GPUS >= 2 )) && lay=1gpu,dp2
  "$PY" benchmarks/report.py digits-folder "$folder" --size "$FOLDER_SIZE"
  mkdir -p "$RUN_DIR/input"
  local runs=()
  for name in ${lay//,/ }; do
    local dp=1; [[ $name == dp2 ]] && dp=2
    log "input: python -m rayconv.run --data imagefolder --data-dir $folder --dp $dp"
    rm -rf "$RUN_DIR/input/run-$name"
    timeout "$PART_TIMEOUT" "$PY" -m rayconv.run --data imagefolder --data-dir "$folder" --image-size "$FOLDER_SIZE" --model convnet \
      --data-on-device off \
      --dp "$dp" --epochs "$EPOCHS" --eval-every 5 --compile off --device "$DEVICE" --no-progress \
      --out "$RUN_DIR/input/run-$name" >> "$RUN_DIR/log.txt" 2>&1 || log "input $name: failed ($RUN_DIR/log.txt)"
    runs+=("$name=$RUN_DIR/input/run-$name")
  done
  "$PY" benchmarks/report.py collect "$RUN_DIR/input/curve.parquet" "${runs[@]}" || true
  rm -rf "$RUN_DIR"/input/run-*/
}
part_real() {
  local jpegs=${TMPDIR:-/tmp}/rayconv-jpegs shards=${TMPDIR:-/tmp}/rayconv-shards lay=1gpu gen=(--classes 100 --train-per-class 80)
  (( GPUS >= 2 )) && lay=1gpu,dp2
  [[ $DEVICE == cpu ]] && gen=(--classes 4 --train-per-class 8 --width 64 --height 48)
  [[ -d $jpegs ]] || "$PY" benchmarks/make_images.py "$jpegs" "${gen[@]}" --val-per-class 10 >> "$RUN_DIR/log.txt" 2>&1
  "$PY" -m rayconv.prepare "$jpegs" --out "$shards" 2>&1 | tee -a "$RUN_DIR/log.txt" | tail -1
  local real=(--models "$RESNET" --layouts "$lay" --global-batch-size "$BATCH" --no-anchors)
  bench real-synthetic "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" "${real[@]}"
  bench real-shards-cpu "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" "${real[@]}" --data shards --data-dir "$shards" --decode cpu \
    --data-on-device off
  [[ $DEVICE == cuda ]] && bench real-shards-gpu "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" "${real[@]}" \
    --data shards --data-dir "$shards" --decode gpu --data-on-device off
  mkdir -p "$RUN_DIR/real-decode"
  local dec=(); [[ $DEVICE == cpu ]] && dec=(--images 64 --batch 16 --workers 1)
  timeout "$PART_TIMEOUT" "$PY" -u benchmarks/input_bench.py --device "$DEVICE" "${dec[@]}" --out "$RUN_DIR/real-decode" \
    2>&1 | tee -a "$RUN_DIR/log.txt" | grep -v '^#' || log "real: input_bench failed ($RUN_DIR/log.txt)"
}
part_plan() {
  mkdir -p "$RUN_DIR/plan"
  export RAYCONV_CACHE_DIR="$RUN_DIR/plan/cache"
  timeout "$PART_TIMEOUT" "$PY" -u benchmarks/plan_check.py --model "$ALEX" --global-batch-size "$BATCH" --top 3 \
    --device "$DEVICE" "${STEPS[@]}" --out "$RUN_DIR/plan" >> "$RUN_DIR/log.txt" 2>&1 || log "plan: plan_check failed ($RUN_DIR/log.txt)"
  cat "$RUN_DIR/plan/plan_check.md" 2>/dev/null || true
  timeout 120 "$PY" -m rayconv.plan --model "$ALEX" --global-batch-size "$BATCH" --device "$DEVICE" --machine all \
    --top 8 > "$RUN_DIR/plan/machines.txt" 2>&1 || log "plan: rayconv.plan --machine all failed"
  rm -rf "$RUN_DIR/plan/cache"
}
part_dp-mp() {
  needs 2 dp-mp || return 0
  bench dp-mp "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX" --layouts dp2,fs2,pp2m4,plan2 \
    --global-batch-size "$BATCH"
  bench dp-mp-2012 "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX2012" --layouts fs2 \
    --global-batch-size "$BATCH" --no-anchors
}
part_dp-mp-resnet() {
  needs 2 dp-mp-resnet || return 0
  bench dp-mp-resnet "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$RESNET" --layouts dp2,fs2,pp2m4 \
    --global-batch-size "$BATCH"
}
part_mp-overlap() {
  needs 2 mp-overlap || return 0
  bench mp-overlap "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX" --layouts 1gpu,fs2,fs2c2,fs2c4,fs2c8 \
    --global-batch-size "$BATCH" --no-anchors
  bench mp-overlap-2012 "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX2012" --layouts 1gpu,fs2,fs2c4 \
    --global-batch-size "$BATCH" --no-anchors
  bench mp-overlap-plan "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX" --layouts 1gpu,plan2 \
    --global-batch-size "$((BATCH * 4))" --no-anchors
}
part_pp-bound() {
  needs 2 pp-bound || return 0
  bench pp-bound "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$RESNET" \
    --layouts 1gpu,pp2m4,pp2m4v2,pp2m8,pp2m8v2,pp2m4-gpipe --global-batch-size "$((BATCH * 2))" --no-anchors --trace 3
}
part_hybrid() {
  needs 4 hybrid || return 0
  bench hybrid "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX" \
    --layouts dp4,fs4,dp2xfs2,dp2xpp2m4,plan4 --global-batch-size "$BATCH"
  bench hybrid-resnet "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$RESNET" --layouts dp4,dp2xpp2m4 \
    --global-batch-size "$BATCH"
}
part_scale() {
  needs 8 scale || return 0
  bench scale "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$ALEX" --layouts dp8,dp4xfs2,plan8 \
    --global-batch-size "$BATCH"
  bench scale-resnet "${COMMON[@]}" "${SIZE[@]}" "${STEPS[@]}" --models "$RESNET" --layouts dp8,dp4xpp2m4 \
    --global-batch-size "$BATCH"
}
part_report() {
  "$PY" benchmarks/report.py report "$RUN_DIR"
}

log "machine $MACHINE ($GPUS devices, $DEVICE), results in $RUN_DIR"
for p in "${todo[@]}"; do
  t0=$SECONDS
  "part_$p"
  log "$p: done in $((SECONDS - t0)) s"
done
