#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it measures, one JSON line per check) as it runs on
# a lent GPU: a fresh machine with torch, transformers 5.17 and accelerate but without hydra,
# omegaconf, gguf, DeepSpeed or our transformers, and no network. So:
#
#   here, once:   bash scripts/gpu_check.sh pack   -> .whl/ (git-ignored): the wheels it lacks, at
#                                                     the versions installed here, <= 60 MiB
#   device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=420)
#   CI:           bash scripts/gpu_check.sh --cpu  (the same checks on a tiny target)
#
# The run installs the wheels into /tmp/site (ahead of the image's own packages), then runs the
# checks under a hard limit (LIMIT, default 360 s; checks not begun 45 s before it are skipped),
# and leaves 3 files in $OUT (the device tool brings back 8): gpu_check.jsonl, gpu_check.log
# (stderr) and nvidia-smi.txt. Nothing is downloaded there: the target and batches are random.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
# What the lent image lacks (or holds too old), by distribution name, each followed by its own
# needs that the image also lacks; the versions are those installed here. PyPI has only sources
# of the last two: they become pure-Python wheels here.
BUNDLE=(transformers huggingface_hub httpx2 httpcore2 truststore click hydra-core omegaconf gguf
    accelerate hjson pydantic pydantic-core annotated-types typing-inspection)
FROM_SOURCE=(antlr4-python3-runtime deepspeed)
MAX_MIB=60

pins() {  # NAME==VERSION installed here, for each name
    local p
    for p in "$@"; do
        echo "$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")"
    done
}

pack() {
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # Wheels for the lent machine's Python 3.12 on x86-64.
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$WHEELS" $(pins "${BUNDLE[@]}")
    "$PY" -m pip wheel -q --no-deps -w "$WHEELS" $(pins "${FROM_SOURCE[@]}")
    local mib
    mib=$(du -sm "$WHEELS" | cut -f1)
    ls "$WHEELS"
    echo "$WHEELS: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $mib MiB"
    if [ "$mib" -gt "$MAX_MIB" ]; then
        echo "error: $WHEELS holds $mib MiB, over the $MAX_MIB MiB a device call may carry beside the tree" >&2
        exit 1
    fi
}

run() {
    local out=${OUT:-/tmp/gpu-check} limit=${LIMIT:-360}
    mkdir -p "$out"
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$WHEELS"/*.whl
        export PYTHONPATH=/tmp/site
    fi
    # scripts/ for its bench_train module, the checkout for the packages.
    export PYTHONPATH="$PWD/scripts:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if [ "${1:-}" != "--cpu" ]; then
        nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
    fi
    # -k: a CUDA call that ignores SIGTERM is killed 10 s later; what was written stays in $out.
    timeout -k 10 "$limit" "$PY" scripts/gpu_check.py "$@" --out "$out" --deadline $((limit - 45)) \
        2>"$out/gpu_check.log"
}

case "${1:-}" in
    pack) pack ;;
    *) run "$@" ;;
esac
