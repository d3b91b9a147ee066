#!/usr/bin/env bash
# Set up (first run only) and run the demo: normalizers side by side on a toy attention.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/demo.py "$@"
