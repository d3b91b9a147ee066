#!/usr/bin/env bash
# Set up (first run only) and run the test suite with pytest; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core (pytest-xdist; an idle worker takes queued tests from a busy one, so a
# few long tests do not leave a core idle at the end); PYTEST_WORKERS=0 runs in one process.
exec "${PYTHON:-python3}" -m pytest -q -n "${PYTEST_WORKERS:-auto}" --dist worksteal "$@"
