"""client/options.py: ClientOptions, the one validated configuration of both twins."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from carpool.client.options import ClientOptionArgs, ClientOptions


def test_defaults() -> None:
    options = ClientOptions()
    assert options.default_timeout_s == 10.0
    assert options.grace_s == 1.0
    assert options.shared_memory == 0
    assert options.shared_memory_min_bytes == 64 * 1024
    assert options.shared_memory_mode == 0o600
    assert options.shared_memory_outputs is False
    assert options.shared_memory_group is None
    assert options.send_timeout_s is None


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientOptions().grace_s = 2.0  # type: ignore[misc]


def test_keyword_arguments_name_every_option() -> None:
    fields = {f.name for f in dataclasses.fields(ClientOptions)}
    assert set(ClientOptionArgs.__annotations__) == fields


@pytest.mark.parametrize(
    "good",
    [
        {"default_timeout_s": 3600.0},
        {"default_timeout_s": 0.001},
        {"grace_s": 0.0},
        {"send_timeout_s": 0.0},
        {"send_timeout_s": math.inf},
        {"shared_memory_min_bytes": 0},
    ],
)
def test_edges_accepted(good: dict[str, Any]) -> None:
    ClientOptions(**good)


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"default_timeout_s": 0.0}, "default_timeout_s"),
        ({"default_timeout_s": 3600.5}, "default_timeout_s"),
        ({"default_timeout_s": math.nan}, "default_timeout_s"),
        ({"grace_s": -0.1}, "grace_s"),
        ({"grace_s": math.inf}, "grace_s"),
        ({"grace_s": math.nan}, "grace_s"),
        ({"send_timeout_s": -1.0}, "send_timeout_s"),
        ({"send_timeout_s": math.nan}, "send_timeout_s"),
        ({"shared_memory": -1}, "shared_memory"),
        ({"shared_memory_min_bytes": -1}, "shared_memory_min_bytes"),
    ],
)
def test_out_of_range_refused_by_name(bad: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} "):
        ClientOptions(**bad)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match=r"default_timeout_s .*; grace_s .*; send_timeout_s"):
        ClientOptions(default_timeout_s=-1.0, grace_s=-1.0, send_timeout_s=-1.0)


def test_one_options_value_opens_both_twins() -> None:
    from carpool.client import AsyncClient, Client

    options = ClientOptions(default_timeout_s=2.0, grace_s=0.5, send_timeout_s=0.1)
    client = Client("tcp://127.0.0.1:9", options=options)
    try:
        assert client.options is options
        assert (client.core.default_timeout_s, client.core.grace_s) == (2.0, 0.5)
    finally:
        client.close()

    async def twin() -> ClientOptions:
        async with AsyncClient("tcp://127.0.0.1:9", options=options) as aclient:
            assert (aclient.core.default_timeout_s, aclient.core.send_timeout_s) == (2.0, 0.1)
            return aclient.options

    assert asyncio.run(twin()) is options


def test_an_options_value_and_keyword_options_together_are_refused() -> None:
    from carpool.client import AsyncClient, Client

    for twin in (Client, AsyncClient):
        with pytest.raises(TypeError, match="not both"):
            twin("tcp://127.0.0.1:9", options=ClientOptions(), grace_s=2.0)
