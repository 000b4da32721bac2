"""ops: the operator's commands over a running fleet: ``carpool status`` and ``carpool top``.

:mod:`carpool.ops.fleet` turns a STATS reply into the fleet's verdict and tables (pure);
:mod:`carpool.ops.status` and :mod:`carpool.ops.top` ask the broker and draw them.
"""

from __future__ import annotations

from typing import Any


def add_parsers(sub: Any) -> None:
    """Register ``status`` and ``top`` on ``carpool``'s sub-command parsers."""
    from carpool.ops import status, top

    status.add_parsers(sub)
    top.add_parsers(sub)
