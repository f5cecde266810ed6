#!/usr/bin/env bash
# bench/perf/omni_gpu.sh [OMNI_DIR]: Qwen2.5-Omni served on a GPU, measured (never in CI).
#
# One short run (under five minutes) of `python -m bench.perf.omni --device cuda` for a machine with a
# CUDA GPU: the checkpoint OMNI_DIR (a local Qwen2.5-Omni directory) or, without one, the tiny random
# checkpoint built for the run.  Everything it finds goes to $OUT (default ./omni-gpu-results):
#   nvidia-smi.txt   the GPU it ran on
#   env.txt          python, torch, CUDA and transformers versions
#   omni.json        first text, first audio, end and real-time factor per mode and per stage
#   omni.md          the same as the table docs/performance.md shows
#   omni.log         the run's output
# Nothing is downloaded: PYTHON (default .venv/bin/python, else python3) must already have this
# project, a CUDA torch and transformers 5.14 installed.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-omni-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT/nvidia-smi.txt"
"$PY" - > "$OUT/env.txt" 2>&1 <<'EOF'
import sys, torch, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "transformers", transformers.__version__)
assert torch.cuda.is_available(), "no CUDA device"
EOF
args=(--device cuda --requests 3 --stream-codes 8,16,32 --json "$OUT/omni.json"
      --machine "$(head -n 1 "$OUT/env.txt")")
if [ $# -ge 1 ]; then args+=(--checkpoint "$1"); fi
printf '<!-- omni:begin -->\n<!-- omni:end -->\n' > "$OUT/omni.md"
args+=(--markdown "$OUT/omni.md")
status=0
timeout 280 "$PY" -m bench.perf.omni "${args[@]}" > "$OUT/omni.log" 2>&1 || status=$?
echo "bench.perf.omni exited $status; results in $OUT" | tee -a "$OUT/omni.log"
exit "$status"
