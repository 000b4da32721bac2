"""notify.py: the worker's systemd notifications — ready, healthy, and its STATUS= line.

READY=1 once the engines are built and warm (the server's constructor) and the broker has
answered this connection's READY: its first heartbeat or batch, never a DISCONNECT
(``WorkerCore.registered``). WATCHDOG=1 only while the inference thread is alive and has
not been inside one batch longer than ``hung_batch_s``: an engine that hangs (a wedged GPU,
a deadlock in a runtime) stops the pings, and systemd restarts the worker, as a wedged
loop does. STATUS=: the models, batches done and failed, ρ and the broker connection.
While the engines start (a TensorRT plan built at start takes minutes), EXTEND_TIMEOUT_USEC
keeps the unit's start timeout ahead of the wait, up to the worker's ``start_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable

from carpool.common.sdnotify import SdNotifier
from carpool.common.supervision import LoopWatch
from carpool.worker.inference import STARTING_EVERY_S
from carpool.worker.server import WorkerServer

#: What an extension of the start timeout adds beyond the next message, and beyond the
#: worker's own limit (which then ends the start with its error, not systemd's kill).
_EXTEND_MARGIN_S = 5.0


def worker_trouble(alive: bool, busy_ms: int, hung_batch_s: float) -> str | None:
    """Why a worker is not well (None: it is): its inference thread is not ``alive``, or
    has been in one batch for ``busy_ms``, past ``hung_batch_s`` (0: batches never hang)."""
    if not alive:
        return "the inference thread has ended"
    busy_s = busy_ms / 1000
    if hung_batch_s > 0 and busy_s > hung_batch_s:
        return f"a batch has run {busy_s:.0f} s (hung_batch_s {hung_batch_s:g})"
    return None


def worker_status(server: WorkerServer) -> str:
    core = server.core
    link = "registered" if core.registered else "connecting"
    return (
        f"model={','.join(core.specs)} batches={core.batches_done} "
        f"failed={core.batches_failed} rho={core.meter.rho(server.clock.now()):.2f} "
        f"broker={link}"
    )


def worker_watch(server: WorkerServer, notifier: SdNotifier, hung_batch_s: float) -> LoopWatch:
    """The LoopWatch for ``server``'s loop (``WorkerServer.serve(watch)``)."""
    return LoopWatch(
        notifier,
        lambda: worker_status(server),
        ready=lambda: server.core.registered,
        trouble=lambda: worker_trouble(
            server.inference_alive, server.core.busy_ms(server.clock.now()), hung_batch_s
        ),
    )


def start_extension(
    notifier: SdNotifier, models: int, start_timeout_s: float
) -> Callable[[float], None]:
    """What a starting worker tells systemd each time it has waited another while
    (``WorkerServer(starting=)``): more start time (EXTEND_TIMEOUT_USEC: until its next
    message, at most until its own ``start_timeout_s`` is over) and how long it has
    waited (STATUS=)."""

    def starting(waited_s: float) -> None:
        ahead_s = min(2 * STARTING_EVERY_S, max(0.0, start_timeout_s - waited_s))
        notifier.send(
            EXTEND_TIMEOUT_USEC=round((ahead_s + _EXTEND_MARGIN_S) * 1e6),
            STATUS=f"starting {models} models: {waited_s:.0f} s of at most {start_timeout_s:g} s",
        )

    return starting
