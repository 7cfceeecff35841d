"""A pytest plugin (loaded by conftest.py): an xdist worker ignores SIGINT once its session has
finished.

When the controller has every worker's results it closes their execnet gateways, and execnet
sends SIGINT to a worker whose run has not returned 5 s later (on a loaded machine, tearing down
a worker that holds thousands of compiled programs can take that long). The KeyboardInterrupt
then lands in whatever the worker is doing (a garbage-collector callback, an unconfigure hook)
and its traceback is printed after the run's summary, though every test passed. The results are
already sent, so the worker just finishes its teardown instead (execnet still ends it with
os._exit 10 s later if it hangs). A user's Ctrl-C is the controller's to handle."""

from __future__ import annotations

import signal

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker, not the controller
        signal.signal(signal.SIGINT, signal.SIG_IGN)
