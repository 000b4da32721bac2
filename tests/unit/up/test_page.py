"""The fleet page's server: who may read the figures and change the fleet (refusal, pure),
then the same over real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from carpool.up.page import Access, PageServer, is_loopback, refusal

TOKEN = "s3cret-token-0123456789"


def _headers(port: int, **extra: str) -> dict[str, str]:
    return {"Host": f"127.0.0.1:{port}", **extra}


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.5.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("192.168.1.20", False),
        ("example.org", False),
    ],
)
def test_loopback_is_told_apart(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_same_origin_get_is_served_without_a_token_on_loopback() -> None:
    access = Access(TOKEN, loopback=True)
    assert refusal("GET", "/api/fleet", _headers(8080), access) is None
    same = _headers(8080, Origin="http://127.0.0.1:8080")
    assert refusal("GET", "/api/fleet", same, access) is None
    assert refusal("GET", "/", {"Host": "localhost:8080"}, access) is None
    # Through an SSH tunnel (ssh -L 9000:127.0.0.1:8080): the browser's port, not ours.
    tunnel = {"Host": "127.0.0.1:9000", "Origin": "http://127.0.0.1:9000"}
    assert refusal("GET", "/api/fleet", tunnel, access) is None
    assert refusal("GET", "/api/fleet", {"Host": "[::1]:8080"}, access) is None


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "http://127.0.0.1:8081", "https://127.0.0.1:8080", "null"]
)
def test_another_origin_is_refused_whatever_it_asks(origin: str) -> None:
    access = Access(TOKEN, loopback=True)
    for method, path in [("GET", "/"), ("GET", "/api/fleet"), ("POST", "/api/workers")]:
        headers = _headers(8080, Origin=origin, Authorization=f"Bearer {TOKEN}")
        assert refusal(method, path, headers, access) == 403


def test_a_host_header_that_names_another_server_is_refused() -> None:
    """A DNS name rebound to 127.0.0.1 reaches the page with its own name as Host (and
    as Origin: the same origin, to the browser)."""
    access = Access(TOKEN, loopback=True)
    assert refusal("GET", "/api/fleet", {"Host": "rebound.example:8080"}, access) == 403
    rebound = {"Host": "rebound.example:8080", "Origin": "http://rebound.example:8080"}
    assert refusal("GET", "/api/fleet", rebound, access) == 403
    assert refusal("GET", "/api/fleet", {}, access) == 403


def test_a_post_needs_the_token() -> None:
    access = Access(TOKEN, loopback=True)
    assert refusal("POST", "/api/workers", _headers(8080), access) == 401
    wrong = _headers(8080, Authorization="Bearer nope")
    assert refusal("POST", "/api/workers", wrong, access) == 403
    basic = _headers(8080, Authorization=f"Basic {TOKEN}")
    assert refusal("POST", "/api/workers", basic, access) == 401
    good = _headers(8080, Authorization=f"Bearer {TOKEN}")
    assert refusal("POST", "/api/workers", good, access) is None


def test_off_loopback_the_figures_need_the_token_too() -> None:
    access = Access(TOKEN, loopback=False)
    headers = {"Host": "192.168.1.20:8080"}
    assert refusal("GET", "/", headers, access) is None  # the page itself: no secrets
    assert refusal("GET", "/api/fleet", headers, access) == 401
    authorized = {**headers, "Authorization": f"Bearer {TOKEN}"}
    assert refusal("GET", "/api/fleet", authorized, access) is None


# ---------------------------------------------------------------------- over HTTP


@pytest.fixture
def page() -> Iterator[tuple[PageServer, list[int]]]:
    asked: list[int] = []

    def scale(n: int) -> str | None:
        if n > 4:
            return "workers must be in 1..4"
        asked.append(n)
        return None

    server = PageServer("127.0.0.1", 0, TOKEN, lambda: {"desired": 2}, scale)
    server.start()
    yield server, asked
    server.close()


def _request(
    server: PageServer, method: str, path: str, body: Any = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_the_page_and_its_assets_are_served_from_the_package(page) -> None:
    server, _ = page
    status, headers, body = _request(server, "GET", "/")
    assert status == 200
    assert b'src="/static/fleet.js"' in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for name, kind in [("fleet.js", "text/javascript"), ("fleet.css", "text/css")]:
        status, headers, body = _request(server, "GET", f"/static/{name}")
        assert status == 200
        assert headers["Content-Type"].startswith(kind)
        assert b"http" not in body.replace(b"http.server", b"")  # nothing from elsewhere
    assert _request(server, "GET", "/static/../page.py")[0] == 404
    assert json.loads(_request(server, "GET", "/api/fleet")[2]) == {"desired": 2}


def test_a_post_with_the_token_changes_the_fleet_and_one_without_does_not(page) -> None:
    server, asked = page
    body = {"workers": 3}
    assert _request(server, "POST", "/api/workers", body)[0] == 401
    assert _request(server, "POST", "/api/workers", body, Authorization="Bearer x")[0] == 403
    foreign = {"Origin": "http://evil.example", "Authorization": f"Bearer {TOKEN}"}
    assert _request(server, "POST", "/api/workers", body, **foreign)[0] == 403
    assert asked == []
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, _, reply = _request(server, "POST", "/api/workers", body, **auth)
    assert (status, json.loads(reply)) == (200, {"workers": 3})
    assert asked == [3]
    status, _, reply = _request(server, "POST", "/api/workers", {"workers": 9}, **auth)
    assert (status, json.loads(reply)["error"]) == (400, "workers must be in 1..4")
    for bad in [{"workers": "3"}, {"workers": True}, {"n": 3}, [3]]:
        assert _request(server, "POST", "/api/workers", bad, **auth)[0] == 400
    assert asked == [3]


def test_a_foreign_origin_cannot_read_the_figures(page) -> None:
    server, _ = page
    status, _, body = _request(server, "GET", "/api/fleet", Origin="http://evil.example")
    assert status == 403
    assert b"desired" not in body
