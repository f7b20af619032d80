#!/usr/bin/env bash
# Build llama.cpp's `llama-server` once, from the llama.cpp that the `llama-cpp-python` source
# distribution on PyPI vendors (a package registry is all these machines reach), into .llama-cpp/
# (scripts/check_llama_cpp.py and its tests look there). That llama.cpp drafts with EAGLE-3,
# DFlash and DSpark heads (`--spec-type draft-eagle3|draft-dflash|draft-dspark`, `-md draft.gguf`).
# Cached: a second run with the same version returns at once. Built for this CPU (GGML_NATIVE), so
# the folder is not to be copied to another machine; no CURL (no downloads at run time), no web UI.
#
# One line is added to that llama.cpp: its qwen2 graph (Qwen2 / Qwen2.5 targets) records each
# layer's input (`res->t_layer_inp[il] = inpL`) as its llama and qwen3 graphs do. draft-eagle3 reads
# the target's aux layers from there; without it llama-server aborts at the first drafted request of
# a Qwen2.5 target (`GGML_ASSERT(t_layer_inp[il] != nullptr)`). It only marks a tensor the graph
# already computes, so greedy decoding is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${LLAMA_CPP_DIR:-.llama-cpp}"
VERSION=0.3.36
BUILD="$VERSION+qwen2-layer-inputs"
if [ -x "$OUT/bin/llama-server" ] && [ "$(cat "$OUT/version" 2>/dev/null)" = "$BUILD" ]; then
    echo "llama.cpp of llama-cpp-python $BUILD ready in $OUT"
    exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
QWEN2="$SRC/src/models/qwen2.cpp"
sed -i 's/^\( *\)ggml_tensor \* inpSA = inpL;/\1res->t_layer_inp[il] = inpL;\n&/' "$QWEN2"
grep -q "res->t_layer_inp\[il\] = inpL;" "$QWEN2" || { echo "patching $QWEN2 failed" >&2; exit 1; }
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    >"$WORK/cmake.log" || { cat "$WORK/cmake.log" >&2; exit 1; }
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >"$WORK/build.log" \
    || { tail -50 "$WORK/build.log" >&2; exit 1; }
# Written under a temporary name, then renamed: a killed build leaves no half folder behind.
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp/bin"
cp "$WORK/build/bin/llama-server" "$OUT.tmp/bin/"
echo "$BUILD" >"$OUT.tmp/version"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
"$OUT/bin/llama-server" --version 2>&1 | head -2
echo "llama.cpp of llama-cpp-python $BUILD ready in $OUT"
