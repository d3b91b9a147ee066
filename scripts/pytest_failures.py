"""A pytest plugin that appends each failure (node id, phase, traceback) to ``$FAILURE_LOG`` as it happens.

For runs that may be stopped at a time limit before pytest prints its summary (``scripts/gpu_check.sh``):
under pytest-xdist the controller receives every worker's reports, so the controller alone writes (a worker
writing too would log each failure twice).  Load it with ``-p pytest_failures`` (``scripts/`` on ``PYTHONPATH``).
"""

import os

_writes = True


def pytest_configure(config) -> None:
    global _writes
    _writes = not hasattr(config, "workerinput")  # an xdist worker: its controller writes


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("FAILURE_LOG")
    if _writes and path and report.failed:
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
