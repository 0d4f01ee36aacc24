#!/usr/bin/env bash
# Set up (with test dependencies) and run the whole test suite. The tests install
# what they need from Debian themselves (etcd-server, prometheus) when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest -ra "$@"
