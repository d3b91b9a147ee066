"""A pytest plugin that appends each failure (node id, phase, traceback) to ``$FAILURE_LOG`` as it happens.

For runs that may be stopped at a time limit before pytest prints its summary (``scripts/gpu_check.sh``):
under pytest-xdist the controller receives every worker's reports, so one file collects them all.
Load it with ``-p pytest_failures`` (``scripts/`` on ``PYTHONPATH``).
"""

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
