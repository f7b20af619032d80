#!/usr/bin/env bash
# The figures only a GPU gives, in one run of at most 9 minutes on one H100/H200-class GPU:
#   1. the EAGLE-3 main job at GPU scale (regenerate -> capture -> train -> export);
#   2. decoding speed with the head it trained, chain and tree (scripts/bench_decode.py), in
#      bf16 and in float32 (where greedy speculative output must equal plain greedy exactly);
#   3. bf16 training throughput of both heads (scripts/bench_train.py, [32, 512] batches);
#   4. SpecForge's training-step benchmark at its shapes (scripts/bench_train.py preset=specforge:
#      a random Llama-3.2-1B-shaped target, 3 document profiles x padded / packed, 5 warm-up and
#      20 timed steps each; no data, ~30-60 s), for the table to set beside SpecForge's figures;
#   5. regeneration throughput against the bare forward (scripts/bench_regen.py, batch 256);
#   6. (only when STAGES names "budget") the main job planned for BUDGET (default 3m) by
#      trainer/plan.py: the plan line it prints and its summary.json's rates and stage times.
#   7. (only on a node with 2+ GPUs) target.device_map=balanced: a tiny target split over the
#      GPUs captures what it captures on one, offline and online (tests/unit/data_prep/test_device_map.py).
# STAGES picks some of them (default "main decode train specforge regen"); the run ends with one table.
# Every stage has its own time limit (together 230 + 2x60 + 2x35 + 60 + 60 = 540 s, the 9 minutes), so a slow stage costs its own figure, not the others'; the
# main job keeps its best head so far, which stage 2 measures even if training was cut short.
# SAMPLES=2000 keeps the regeneration stage short on an H200 (README, Measured:
# "gpu_figures.sh, regeneration stage").
#
#   OUT=<dir> [TARGET=<alias|.gguf|folder|hub id>] [SOURCE=sharegpt|<file.jsonl>] [STAGES=...] \
#       [SAMPLES=2000] [EPOCHS=3] [MAIN_LIMIT=230] [PYTHON=python3] bash scripts/gpu_figures.sh [main-job overrides]
set -u
OUT=${OUT:?set OUT to the folder for logs and JSON}
STAGES=${STAGES:-main decode train specforge regen}
# On the GPU machine, what scripts/gpu_bundle.sh staged (PYTHONPATH, TARGET, SOURCE).
STAGE_ENV=${STAGE:-/tmp/gpu-stage}/env.sh
# shellcheck disable=SC1090
[ -f "$STAGE_ENV" ] && . "$STAGE_ENV"
# scripts/*.py import the packages from the repository root (python -m already has it on the path).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TARGET=${TARGET:-smollm2-135m-instruct}
SOURCE=${SOURCE:-sharegpt}
SAMPLES=${SAMPLES:-2000}
EPOCHS=${EPOCHS:-3}
RUN=${RUN_DIR:-outputs/gpu-eagle3}
PY=${PYTHON:-python3}
common=("target.name_or_path=$TARGET" "data.source=$SOURCE")
mkdir -p "$OUT"

stage() {  # stage NAME SECONDS command...: log to $OUT/NAME.log, report rc and time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(($(date +%s) - start)) s"
    tail -n 2 "$OUT/$name.log" | cut -c1-1500
}

wants() { [[ " $STAGES " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if wants main; then
    stage main_eagle3 "${MAIN_LIMIT:-230}" "$PY" -m trainer.train +head=eagle3 "${common[@]}" run_dir="$RUN" \
        data.max_samples="$SAMPLES" data.max_length=1024 data.regenerate.max_new_tokens=256 \
        data.regenerate.batch_size=256 data.capture_batch_tokens=65536 data.shard_samples=256 \
        optim.batch_tokens=16384 optim.max_batch_size=64 optim.epochs="$EPOCHS" optim.val_every=40 \
        optim.save_every=100000 pipeline.evaluate=false logging.progress=false "$@"
    for f in summary.json history.json; do
        [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/$f"
    done
fi
if wants budget; then
    stage main_budget "${BUDGET_LIMIT:-240}" "$PY" -m trainer.train +head=eagle3 "${common[@]}" \
        run_dir="$RUN-budget" budget="${BUDGET:-3m}" data.max_length=1024 data.regenerate.batch_size=256 \
        data.capture_batch_tokens=65536 data.shard_samples=256 optim.batch_tokens=16384 \
        optim.max_batch_size=64 optim.val_every=40 optim.save_every=100000 logging.progress=false "$@"
    [ -f "$RUN-budget/summary.json" ] && cp "$RUN-budget/summary.json" "$OUT/summary-budget.json"
fi
if wants decode; then
    for dtype in bfloat16 float32; do
        stage "bench_decode_$dtype" 60 "$PY" scripts/bench_decode.py head="$RUN/head" "${common[@]}" \
            target.dtype=$dtype reps=1 eval.max_new_tokens=96
    done
fi
if wants train; then
    for head in eagle3 medusa; do
        stage "bench_train_$head" 35 "$PY" scripts/bench_train.py +head=$head "${common[@]}" \
            optim.batch_tokens=16384
    done
fi
if wants specforge; then
    stage bench_train_specforge 60 "$PY" scripts/bench_train.py preset=specforge
fi
if wants regen; then
    stage bench_regen 60 "$PY" scripts/bench_regen.py "${common[@]}" prompts=1024 \
        data.max_length=1024 data.regenerate.max_new_tokens=256 data.regenerate.batch_size=256 \
        data.capture_batch_tokens=65536
fi
if "$PY" -c "import vllm" 2>/dev/null; then  # the stock hidden-states connector on CUDA vs transformers
    stage capture_vllm 60 env PYTHONPATH=. "$PY" scripts/check_capture.py smollm2-135m-instruct
fi
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    stage devmap 60 "$PY" -m pytest tests/unit/data_prep/test_device_map.py -q -p no:cacheprovider
fi
"$PY" scripts/gpu_table.py "$OUT"
