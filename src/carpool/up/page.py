"""page.py: the live fleet page of ``carpool up --page HOST:PORT`` — an HTTP server.

Routes: ``GET /`` (the page), ``GET /static/NAME`` (its script and style, shipped in the
package: no CDN), ``GET /api/fleet`` (the figures, JSON, polled by the page about once a
second) and ``POST /api/workers`` (``{"workers": N}``: change the number of workers).

Who may do what is decided by :func:`refusal`, pure:

- A request whose ``Origin`` is not the origin it was sent to (``http://`` + its
  ``Host``) is refused (403), whatever it asks: another site's script in the operator's
  browser can neither read nor drive the fleet. Bound to loopback, its ``Host`` must be
  a loopback name too (any port: an SSH tunnel's), so a DNS name rebound to 127.0.0.1
  gets nothing either; bound elsewhere, everything but the page itself needs the token.
- ``POST /api/workers`` needs the token (``Authorization: Bearer TOKEN``; 401 without,
  403 with a wrong one). ``carpool up`` prints the token at start, in the page's URL
  (``#token=...``: a fragment, never sent to a server or written to its logs).
- Bound to anything but loopback, the figures need the token too.

stdlib ``http.server`` (``ThreadingHTTPServer``) on a thread of its own: a page for an
operator or two, no framework needed.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Protocol

from carpool.common.listen import SHUTDOWN_POLL_S

logger = logging.getLogger(__name__)

STATIC = {
    "index.html": "text/html; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "fleet.css": "text/css; charset=utf-8",
}
MAX_BODY_BYTES = 1024


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Headers(Protocol):
    """A request's headers, looked up by name (``http.server``'s are case-insensitive)."""

    def get(self, name: str, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Access:
    """What a request is checked against."""

    token: str
    loopback: bool  # bound to loopback: the figures are open to this host's users


def _hostname(host: str) -> str:
    """The name of a ``Host`` header: ``127.0.0.1:8080`` -> ``127.0.0.1``, ``[::1]:80``
    -> ``::1``."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if ":" in host else host


def refusal(method: str, path: str, headers: Headers, access: Access) -> int | None:
    """The status a request must be refused with (None: go ahead)."""
    host = headers.get("Host")
    if not host:
        return 403
    origin = headers.get("Origin")
    if origin is not None and origin != f"http://{host}":
        return 403
    if access.loopback and not is_loopback(_hostname(host)):
        return 403
    needs_token = method == "POST" or (path.startswith("/api/") and not access.loopback)
    if not needs_token:
        return None
    given = headers.get("Authorization") or ""
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not value:
        return 401
    if not hmac.compare_digest(value.strip().encode(), access.token.encode()):
        return 403
    return None


class PageServer:
    """Serve the page on ``host:port`` until :meth:`close`.

    Args:
        host: the address to bind (a non-loopback one only with a token the operator chose,
            checked by the command before).
        port: the port (0: any free one; :attr:`port` says which).
        token: the token of :func:`refusal`.
        view: the figures (``GET /api/fleet``).
        scale: asks for a new worker count; returns an error message, or None when taken.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        view: Callable[[], dict[str, Any]],
        scale: Callable[[int], str | None],
    ) -> None:
        self.view = view
        self.scale = scale
        handler = _handler(self)
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self.access = Access(token, is_loopback(host))
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            args=(SHUTDOWN_POLL_S,),
            name="carpool-up-page",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join(5.0)
        self.httpd.server_close()


def _static(name: str) -> bytes:
    return resources.files("carpool.up").joinpath("static", name).read_bytes()


def _handler(page: PageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "carpool-up"

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("page: " + format, *args)  # noqa: G003 (http.server's own format)

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("X-Frame-Options", "DENY")
            self.send_header(
                "Content-Security-Policy",
                "default-src 'self'; connect-src 'self'; frame-ancestors 'none'",
            )
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def _refused(self, method: str) -> bool:
            status = refusal(method, self.path, self.headers, page.access)
            if status is None:
                return False
            reason = {401: "the token is needed", 403: "refused"}[status]
            self._json(status, {"error": reason})
            return True

        def do_GET(self) -> None:
            if self._refused("GET"):
                return
            path = self.path.split("?", 1)[0]
            name = "index.html" if path == "/" else path.removeprefix("/static/")
            if path == "/api/fleet":
                self._json(200, page.view())
            elif name in STATIC and (path == "/" or path.startswith("/static/")):
                self._send(200, _static(name), STATIC[name])
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self._refused("POST"):
                return
            if self.path != "/api/workers":
                self._json(404, {"error": "not found"})
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY_BYTES:
                self._json(400, {"error": f"a JSON body of 1..{MAX_BODY_BYTES} bytes is needed"})
                return
            try:
                workers = json.loads(self.rfile.read(length))["workers"]
            except (ValueError, KeyError, TypeError):
                workers = None
            if not isinstance(workers, int) or isinstance(workers, bool):
                self._json(400, {"error": 'the body must be {"workers": N}'})
                return
            problem = page.scale(workers)
            if problem is not None:
                self._json(400, {"error": problem})
                return
            logger.info("page: workers set to %d", workers)
            self._json(200, {"workers": workers})

    return Handler
