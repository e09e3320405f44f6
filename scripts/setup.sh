#!/usr/bin/env bash
# Set up .venv with moe-pipeline (editable) and its test tools. Safe to re-run; fast when done.
#
# torch: a torch already importable (a GPU user's CUDA build, visible through
# --system-site-packages) is kept; otherwise torch==2.13.0 is installed first, which on the
# CPU machines this project develops on is the CPU build from local disk. Installing the project
# afterwards then finds torch satisfied instead of pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install -q torch==2.13.0
fi
# DeepSpeed's ops are built just in time (on CPU only the shared-memory comm op, about 20 s once)
DS_BUILD_OPS=0 .venv/bin/pip install -q -e '.[dev,compressed]' 2>&1 | { grep -v -e "is ignored: it is neither" -e "^$" || true; }
# nothing of ours runs at interpreter start (lm-eval gets our model through `moe-pipeline lm-eval`): remove the
# lm-eval hook that older installs of this project put in site-packages
rm -f "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/moe_pipeline_lm_eval.pth"
