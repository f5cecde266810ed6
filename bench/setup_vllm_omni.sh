#!/usr/bin/env bash
# Installs the real vLLM-Omni (CPU only, no CUDA, no triton) into a separate venv, .venv-vllm/,
# together with this project, so that `.venv-vllm/bin/trio-orch bench` (and `compare`) can put the
# `vllm-omni` implementation next to trio-orch in the same run.  Not used by CI; about 2.2 GB.
#
#   bash bench/setup_vllm_omni.sh            # then: .venv-vllm/bin/trio-orch bench --impls vllm-omni,...
#
# and the cancellation comparison with the real vLLM-Omni as columns (a scenario it has no counterpart
# for is an n/a cell with the reason; docs/vllm-omni.md has a run):
#
#   .venv-vllm/bin/trio-orch compare --impl trio --impl omni-event --impl vllm-omni --impl vllm-omni-poll
#
# vllm and vllm-omni are installed with --no-deps (their full dependency set pulls CUDA builds);
# the list below is what their import chain needs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q -c constraints-cpu.txt)
"${PIP[@]}" --no-deps vllm==0.30.0 vllm-omni==0.30.0
"${PIP[@]}" janus msgspec pyzmq numpy torch==2.13.0 aenum==3.1.16 packaging regex pydantic cbor2 psutil \
    urllib3 "transformers>=5.13,<5.15" aiohttp requests openai-harmony openai pillow pybase64 cachetools \
    cloudpickle uvloop py-cpuinfo prometheus_client fastapi partial_json_parser tiktoken loguru einops \
    omegaconf prettytable diffusers==0.40.0
"${PIP[@]}" --no-deps xgrammar llguidance apache-tvm-ffi
"${PIP[@]}" -e '.[dev]'   # this project and its own dependencies (same torch pin)
"$VENV/bin/python" -c "import vllm_omni.engine.orchestrator as m; print('vLLM-Omni orchestrator:', m.__file__)"
