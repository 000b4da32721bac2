"""queries.py: Queries — the STATS and METADATA requests a client awaits — pure.

Each asks the broker something and is answered with one meta map (or an ERROR) that
echoes its id. Several may be in flight at once; each waits for the answer that echoes
its own id, and one given up drops its answer when it comes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from carpool.common.errors import RequestError
from carpool.common.protocol import (
    MetadataRequest,
    ModelMetadata,
    StatsQuery,
    parse_metadata_reply,
)

__all__ = ["Queries", "models_in"]


class Queries:
    """Queries asked and not yet given up: id -> answer (or the broker's error:
    PERMISSION_DENIED under CURVE, NOT_FOUND), None until it arrives.

    Args:
        ids: the client's id count, shared with its requests (an ERROR names either).
    """

    def __init__(self, ids: Iterator[int]) -> None:
        self._ids = ids
        self._queries: dict[int, dict[str, Any] | RequestError | None] = {}

    def stats_request(self) -> tuple[int, list[Any]]:
        """A STATS request, awaited from now on: the reply that echoes the returned id is
        kept for :meth:`answer` until :meth:`forget`."""
        qid = self._ask()
        return qid, StatsQuery(qid).to_frames()

    def metadata_request(self, model: str | None = None) -> tuple[int, list[Any]]:
        """A METADATA request for ``model`` (None: every model), awaited as STATS is."""
        qid = self._ask()
        return qid, MetadataRequest(qid, model).to_frames()

    def _ask(self) -> int:
        qid = next(self._ids)
        self._queries[qid] = None
        return qid

    def answer(self, query_id: int) -> dict[str, Any] | RequestError | None:
        """The broker's answer to STATS or METADATA request ``query_id`` (its meta map,
        or the error it answered); None while it has not come."""
        return self._queries.get(query_id)

    def forget(self, query_id: int) -> None:
        """Stop waiting for query ``query_id`` (answered, or given up): a reply that
        comes later is dropped."""
        self._queries.pop(query_id, None)

    def on_answer(self, meta: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        qid = meta.get("id")
        if type(qid) is int and qid in self._queries:
            self._queries[qid] = meta
            return qid, meta
        return None, meta  # a late answer to a call that gave up, or one nobody asked

    def refused(self, query_id: int | None, error: RequestError) -> bool:
        """The broker answered query ``query_id`` with ``error``; False: no such query."""
        if query_id is None or query_id not in self._queries:
            return False
        self._queries[query_id] = error
        return True


def models_in(answer: dict[str, Any]) -> tuple[ModelMetadata, ...]:
    """The models a METADATA answer describes.

    Raises:
        ProtocolError: the answer is malformed.
    """
    return parse_metadata_reply(answer)[1]
