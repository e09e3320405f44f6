#!/usr/bin/env bash
# README command 1's main job: the tiny recipe end to end, the commands a user would type, one a line.
# Train the teacher and distill its Mixture-of-Students (runs/tiny/teacher, runs/tiny/student), evaluate
# both zero-shot (runs/tiny/eval), export the student (runs/tiny/package), train its expert-demand
# predictor, then serve it on 2 expert-parallel ranks with predictive placement, send one completion
# over HTTP, print it and shut down. About 12 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH="$PWD/.venv/bin:$PATH"

moe-pipeline distill recipes/tiny.yaml
moe-pipeline eval runs/tiny
moe-pipeline export runs/tiny --force
moe-pipeline predictor train runs/tiny/package
moe-pipeline serve runs/tiny/package --ep-size 2 --placement predictive --port 0 --smoke 'And God said'
