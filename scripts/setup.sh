#!/usr/bin/env bash
# Create a virtual environment (idempotent) and install elastic_runner into it with pinned torch.
#   scripts/setup.sh               .venv: torch 2.13.0, runtime + report extra (the quickstart; no torchvision)
#   scripts/setup.sh test          .venv: the same + test dependencies (the short run on torch 2.13.0)
#   scripts/setup.sh docs          .venv: the same + the docs extra (mkdocs: .venv/bin/mkdocs build --strict)
#   scripts/setup.sh vision-test   .venv-vision: torch 2.14.1 + torchvision 0.29.1, vision + test + docs extras (the full suite)
# The versions are pinned in constraints-torch-*.txt; every other package in constraints.txt.
# Set TORCH_INDEX_URL to choose a torch build, e.g.
#   https://download.pytorch.org/whl/cu124  (CUDA 12.4)   https://download.pytorch.org/whl/cpu  (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
case "${1:-run}" in
  run)         VENV=.venv;        PINS=constraints-torch-2.13.txt; EXTRAS=report ;;
  test)        VENV=.venv;        PINS=constraints-torch-2.13.txt; EXTRAS=report,test ;;
  docs)        VENV=.venv;        PINS=constraints-torch-2.13.txt; EXTRAS=report,docs ;;
  vision-test) VENV=.venv-vision; PINS=constraints-torch-2.14.txt; EXTRAS=report,test,vision,docs ;;
  *) echo "usage: scripts/setup.sh [run|test|docs|vision-test]" >&2; exit 2 ;;
esac
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "elastic_runner needs Python >= 3.10")'
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# --no-cache-dir: where torch comes from the network, pip would keep its wheels (GBs for a CUDA build) in ~/.cache
# beside the venv they are installed into; a CI machine's disk filled up that way.
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-cache-dir -q)
TORCH=$(sed -n 's/^torch==//p' "$PINS")
VISION=$(sed -n 's/^torchvision==//p' "$PINS")
WANT=("torch==$TORCH")
[ -n "$VISION" ] && WANT+=("torchvision==$VISION")
HAVE='import sys, torch; ok = torch.__version__.split("+")[0] == sys.argv[1]
if len(sys.argv) > 2:
    import torchvision; ok = ok and torchvision.__version__.split("+")[0] == sys.argv[2]
sys.exit(0 if ok else 1)'
if ! "$VENV/bin/python" -c "$HAVE" "$TORCH" $VISION 2>/dev/null; then
  echo "==> installing ${WANT[*]} into $VENV"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" install "${WANT[@]}" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" install "${WANT[@]}"
  fi
fi
echo "==> installing elastic_runner[$EXTRAS] into $VENV"
"${PIP[@]}" install -c constraints.txt -c "$PINS" -e ".[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" -c 'import elastic_runner, torch; print(f"==> elastic_runner {elastic_runner.__version__} with torch {torch.__version__}")'
