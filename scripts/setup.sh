#!/usr/bin/env bash
# Create .venv (idempotent) and install elastic_runner with pinned torch.
#   scripts/setup.sh            runtime + report extra
#   scripts/setup.sh test       + test dependencies
# Set TORCH_INDEX_URL to choose a torch build, e.g.
#   https://download.pytorch.org/whl/cu124  (CUDA 12.4)   https://download.pytorch.org/whl/cpu  (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "elastic_runner needs Python >= 3.10")'
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
  echo "==> installing torch 2.13.0"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" install "torch==2.13.0"
  fi
fi
EXTRAS=report
if [ "${1:-}" = "test" ]; then EXTRAS=report,test; fi
echo "==> installing elastic_runner[$EXTRAS]"
"${PIP[@]}" install -c constraints.txt -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c 'import elastic_runner, torch; print(f"==> elastic_runner {elastic_runner.__version__} with torch {torch.__version__}")'
