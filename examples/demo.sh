#!/usr/bin/env bash
# `make demo`: the whole loop on one machine (see examples/demo.py for what it does).
#   DEMO_DIR=...  where everything goes (default .demo/)
#   DEMO_EXIT=1   stop after the scenario; exit 0 only if every step converged
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m examples.demo
