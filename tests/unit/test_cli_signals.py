"""The command's signal handler: SIGTERM and SIGINT stop the server, whatever logging
does at that instant."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest

from carpool.cli import _stop_on_signals


class _Broken(logging.Handler):
    """A handler whose write fails as a reentrant write to a mid-write stderr does."""

    def emit(self, record: logging.LogRecord) -> None:
        raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.usefixtures("restore_handlers")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_stop_comes_before_the_log_line(signum: int) -> None:
    stopped: list[bool] = []
    _stop_on_signals(lambda: stopped.append(True))
    logger = logging.getLogger("carpool")
    broken = _Broken()
    logger.addHandler(broken)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(RuntimeError):
            os.kill(os.getpid(), signum)  # the handler runs here, in this thread
    finally:
        logger.removeHandler(broken)
        logger.setLevel(level)
    assert stopped == [True]
