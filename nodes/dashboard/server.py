"""The dashboard's web server: a read-only page and its JSON API over a run folder.

Safe by default:

- It binds to 127.0.0.1 unless told otherwise (``[HOST:]PORT``). On any address that is not
  loopback it needs a token (``--dashboard-token``, or one made at start and printed once
  in the URL), and it serves HTTPS with the coordinator's own certificate
  (``DIR/tls/server.crt``, signed by ``DIR/tls/ca.crt``, which a browser may be told to trust).
- The token goes in the first URL (``/?token=...``), which sets it as a cookie (HttpOnly,
  SameSite=Strict, Secure over HTTPS), or in an ``Authorization: Bearer`` header (``curl``).
  Any request without it is refused (401), the page and its script included.
- Read-only: every route is a GET of the page, its two static files or a JSON document
  (:mod:`nodes.dashboard.view`); no endpoint changes the run, other methods get 405.
- The page's script renders every string as text (``textContent``, never HTML), and the
  Content-Security-Policy allows only this server's own script and style: a node name or
  reason holding ``<script>`` shows as those characters.
- It runs in a daemon thread of the process that starts it; a request that fails answers 503
  with the reason, and nothing in it can stop the coordinator.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Route

from robust import tls

from .. import launch
from .view import RunView, dumps

STATIC = Path(__file__).with_name("static")
COOKIE = "robust_dashboard"
DOCUMENTS = ("status", "rounds", "nodes")
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}
START_WITHIN = 10.0  # seconds the server may take to listen
log = logging.getLogger(__name__)


def parse_bind(spec: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (an IPv6 host in brackets) as ``(host, port)``; the host defaults to 127.0.0.1."""
    host, sep, port = str(spec).rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536 or not host:
        raise ValueError(f"dashboard address {spec!r}: give [HOST:]PORT, e.g. 8050 or 0.0.0.0:8050")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def app(view: RunView, token: str = "", secure: bool = False) -> Starlette:
    """The ASGI app: the page, its script and style, ``/api/status|rounds|nodes``; with a
    ``token``, every request must carry it (see the module)."""

    def allowed(request: Request) -> bool:
        if not token:
            return True
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        given = bearer if scheme.lower() == "bearer" and bearer else given
        return secrets.compare_digest(given.encode(), token.encode())

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            if not allowed(request):
                return Response("this dashboard needs its token: open the URL its coordinator printed "
                                "(/?token=...), or send `Authorization: Bearer TOKEN`\n", 401,
                                media_type="text/plain", headers=HEADERS)
            response = handler(request)
            response.headers.update(HEADERS)
            return response
        return endpoint

    def page(request: Request) -> Response:
        if token and "token" in request.query_params:  # keep the token in a cookie, and out of the address bar
            response = RedirectResponse("/", 303)
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure)
            return response
        return FileResponse(STATIC / "page.html", media_type="text/html")

    def static(name: str, media: str):
        return lambda request: FileResponse(STATIC / name, media_type=media)

    def document(name: str):
        def answer(request: Request) -> Response:
            try:
                return Response(dumps(view.docs()[name]), media_type="application/json")
            except Exception as err:  # a damaged or half-made folder: say so, keep serving
                log.warning("dashboard: /api/%s failed: %s", name, err)
                return Response(dumps({"error": str(err)}), 503, media_type="application/json")
        return answer

    routes = [Route("/", guarded(page)), Route("/app.js", guarded(static("app.js", "text/javascript"))),
              Route("/style.css", guarded(static("style.css", "text/css")))]
    routes += [Route(f"/api/{name}", guarded(document(name))) for name in DOCUMENTS]
    return Starlette(routes=routes)


@dataclass
class Dashboard:
    url: str  # what to open (with the token, when one is needed)
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def start(folder: str | Path, bind: str, token: str = "") -> Dashboard:
    """Serve the dashboard of the run in ``folder`` on ``bind`` (``[HOST:]PORT``) from a daemon
    thread; returns once it listens. Off loopback: a token (``token``, or a new one) and HTTPS
    with the coordinator's certificate."""
    view = RunView(folder)
    host, port = parse_bind(bind)
    secure = not is_loopback(host)
    ssl = {}
    if secure:
        token = token or secrets.token_urlsafe(24)
        cert, key = view.folder / "tls" / tls.SERVER_CERT, view.folder / "tls" / tls.SERVER_KEY
        if not cert.exists() or not key.exists():
            raise ValueError(f"the dashboard on {host} (not loopback) serves HTTPS with the coordinator's certificate, "
                             f"but {cert} or {key} is missing: `robust coordinator init` makes them, or bind to 127.0.0.1")
        ssl = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    config = uvicorn.Config(app(view, token, secure), host=host, port=port, log_config=None, log_level="warning",
                            access_log=False, server_header=False, lifespan="off", ws="none", **ssl)
    server = uvicorn.Server(config)

    def serve() -> None:
        try:
            server.run()
        except (Exception, SystemExit) as err:  # uvicorn exits when it cannot bind: said below
            log.warning("dashboard: the server stopped: %r", err)

    thread = threading.Thread(target=serve, name="dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_WITHIN
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        raise ValueError(f"the dashboard could not listen on {host}:{port} (in use? see the log above): "
                         "give another --dashboard [HOST:]PORT")
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if secure else 'http'}://{shown}:{server.servers[0].sockets[0].getsockname()[1]}/"
    return Dashboard(url + (f"?token={token}" if token else ""), server, thread)


@contextlib.contextmanager
def serving(folder: str | Path, bind: str | None, token: str = "") -> Iterator[Dashboard | None]:
    """The dashboard of ``folder`` served on ``bind`` for the block (none when ``bind`` is empty);
    its URL printed once."""
    if not bind:
        yield None
        return
    board = start(folder, bind, token)
    print(f"dashboard: {board.url}", flush=True)
    try:
        yield board
    finally:
        board.stop()


def wait_for_interrupt() -> None:
    """Serve until Ctrl-C (or SIGTERM)."""
    launch.stop_on_sigterm()
    try:
        while True:
            time.sleep(1.0)
            launch.raise_if_terminated()
    except KeyboardInterrupt:
        pass


def main(folder: str | Path, bind: str, token: str) -> int:
    """``robust dashboard DIR``: serve until Ctrl-C."""
    with serving(folder, bind, token):
        print("read-only; Ctrl-C stops it", flush=True)
        wait_for_interrupt()
    return 0
