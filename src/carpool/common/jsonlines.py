"""jsonlines.py: what reading and writing JSON-lines traces (carpool record, replay) share. Pure."""

from __future__ import annotations

import json


def parses(line: str | bytes) -> bool:
    """Whether ``line`` (one line of a trace, as text or bytes) is a JSON value."""
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
