"""testing.py: carpool's public test kit — a fake clock and helpers to run servers.

Fakes only at our own seams: :class:`FakeClock` stands in for :class:`Clock`; engines are
faked with :class:`carpool.worker.engines.synthetic.SyntheticEngine`. Sockets stay real.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol


class FakeClock:
    """A clock that only moves when told to (or when something sleeps on it)."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now = start_s
        self._cpu = 0.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def cpu(self) -> float:
        """CPU seconds used, as far as :meth:`use_cpu` said (one count for every thread)."""
        with self._lock:
            return self._cpu

    def use_cpu(self, duration_s: float) -> None:
        with self._lock:
            self._cpu += duration_s

    def advance(self, duration_s: float) -> None:
        with self._lock:
            self._now += duration_s

    def sleep(self, duration_s: float) -> None:
        if duration_s > 0:
            self.advance(duration_s)


class Serving(Protocol):
    def serve(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


class ServerThread:
    """Run ``server.serve()`` on a thread; on exit stop it, join it and close the server.

    Example::

        with ServerThread(BrokerServer(config)) as broker:
            ...
    """

    def __init__(self, server: Serving, *, join_timeout_s: float = 10.0) -> None:
        self.server = server
        self.join_timeout_s = join_timeout_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.server.serve()
        except BaseException as exc:  # surfaced to the test on exit
            self.error = exc

    def __enter__(self) -> Any:
        self._thread.start()
        return self.server

    def __exit__(self, *exc_info: object) -> None:
        """Stop, join and close the server; re-raise what ``serve()`` raised, unless the
        ``with`` block is already raising (``exc_info``: its type, value, traceback)."""
        self.server.stop()
        self._thread.join(self.join_timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"{type(self.server).__name__} did not stop in time")
        self.server.close()
        if self.error is not None and exc_info[1] is None:
            raise self.error
