#!/usr/bin/env bash
# Builds the llama.cpp peer used by benchmarks/compare.py and benchmarks/serving.py, from the
# llama.cpp source vendored in the llama-cpp-python sdist (so one pip download pins the
# version), and optionally converts a Hugging Face model folder to GGUF (f32, f16, q8_0) with
# the converter that ships in the same source tree.
#
#   tools/build_llama_cpp.sh OUT_DIR                 # build OUT_DIR/bin/llama-{server,bench,...}
#   tools/build_llama_cpp.sh OUT_DIR --convert HF_DIR [--types "f32 f16 q8_0"]
#   tools/build_llama_cpp.sh OUT_DIR --convert-only HF_DIR
#
# Run it under `nice -n 10`; on 2 cores the build takes 15-25 minutes. The binaries are static
# (BUILD_SHARED_LIBS=OFF) and built for the host CPU (GGML_NATIVE=ON); LLAMA_CMAKE_ARGS adds
# cmake options, e.g. on a CPU with AMX, where the native build's AMX path for Q4_0 / Q4_1 /
# Q8_0 weights crashed on any prompt of 2 or more tokens (llama-cpp-python 0.3.36's sources):
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
#     -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" tools/build_llama_cpp.sh OUT_DIR
set -euo pipefail

usage() { sed -n '2,12p' "$0"; exit 2; }
[[ $# -ge 1 ]] || usage
OUT=$(realpath -m "$1"); shift
HF_DIR=""; BUILD=1; TYPES="f32 f16 q8_0"; VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --convert) HF_DIR=$(realpath "$2"); shift 2 ;;
    --convert-only) HF_DIR=$(realpath "$2"); BUILD=0; shift 2 ;;
    --types) TYPES="$2"; shift 2 ;;
    *) usage ;;
  esac
done
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT/src" "$OUT/bin" "$OUT/gguf"

# 1. Source: the sdist's vendored llama.cpp.
SPEC="llama-cpp-python${VERSION:+==$VERSION}"
if ! ls "$OUT"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
  pip download --no-deps --no-binary :all: "$SPEC" -d "$OUT/src"
fi
SDIST=$(ls "$OUT"/src/llama_cpp_python-*.tar.gz | sort -V | tail -1)
SRC_ROOT="$OUT/src/$(basename "$SDIST" .tar.gz)"
[[ -d "$SRC_ROOT" ]] || tar -xzf "$SDIST" -C "$OUT/src"
LLAMA="$SRC_ROOT/vendor/llama.cpp"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "no vendored llama.cpp in $SDIST" >&2; exit 1; }
(cd "$LLAMA" && grep -m1 -o 'LLAMA_BUILD_NUMBER[^)]*' CMakeLists.txt || true) > "$OUT/VERSION"
echo "$(basename "$SDIST")" >> "$OUT/VERSION"

# 2. Build.
if [[ $BUILD -eq 1 ]]; then
  GEN=(); command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S "$LLAMA" -B "$OUT/build" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    ${LLAMA_CMAKE_ARGS:-}
  cmake --build "$OUT/build" -j "$JOBS" --target llama-server llama-bench llama-batched-bench \
    llama-quantize
  for b in llama-server llama-bench llama-batched-bench llama-quantize; do
    cp "$OUT/build/bin/$b" "$OUT/bin/"
  done
  echo "built: $(ls "$OUT/bin")"
fi

# 3. Convert a Hugging Face folder (config, safetensors, tokenizer) to GGUF.
if [[ -n "$HF_DIR" ]]; then
  export PYTHONPATH="$LLAMA/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
  # The converter's own dependencies: gguf from the same tree (on PYTHONPATH), sentencepiece.
  python -c "import sentencepiece" 2>/dev/null || pip install sentencepiece
  name=$(basename "$HF_DIR")
  for t in $TYPES; do
    python "$(dirname "$0")/convert_to_gguf.py" "$LLAMA" -- "$HF_DIR" --outtype "$t" \
      --outfile "$OUT/gguf/$name-$t.gguf"
  done
  ls -la "$OUT/gguf"
fi
