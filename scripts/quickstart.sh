#!/usr/bin/env bash
# Set up, then train the quickstart as a 2-process elastic job on torchrun's
# embedded c10d rendezvous (no external services). Extra arguments are passed
# to the trainer, e.g.  scripts/quickstart.sh --set train.epochs=2
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
PORT=$(.venv/bin/python -c 'from elastic_runner.testing.localjob import free_port; print(free_port())')
RUN_DIR=${RUN_DIR:-runs/quickstart-$(date +%Y%m%d-%H%M%S)}
echo "==> training; run directory $RUN_DIR"
.venv/bin/elastic-runner launch --nnodes=1:2 --nproc_per_node=2 --rdzv_backend=c10d \
  --rdzv_endpoint="127.0.0.1:$PORT" --rdzv_id=quickstart --max_restarts=3 \
  -m elastic_runner.train --config configs/quickstart.yaml --set "run.dir=$RUN_DIR" "$@"
echo "==> audit of the samples each rank consumed"
.venv/bin/elastic-runner audit "$RUN_DIR"
echo "==> inspect:  .venv/bin/elastic-runner snapshot inspect $RUN_DIR"
