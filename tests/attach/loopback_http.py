"""Real loopback servers for the discovery and scrape tests: an HTTP server answering fixed routes
(the shapes SGLang and vLLM answer with), a TCP server that answers something other than HTTP,
and a port where nothing listens."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = tuple[int, str, bytes]  # status, content type, body


def json_route(doc: Any, status: int = 200) -> Route:
    return status, "application/json", json.dumps(doc).encode()


def text_route(text: str, status: int = 200) -> Route:
    return status, "text/plain; version=0.0.4; charset=utf-8", text.encode()


class RouteServer(ThreadingHTTPServer):
    routes: dict[str, Route]
    asked: list[str]


class Handler(BaseHTTPRequestHandler):
    server: RouteServer

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        status, kind, body = self.server.routes.get(self.path, (404, "text/plain", b"Not Found"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@contextmanager
def http_server(routes: dict[str, Route]) -> Iterator[RouteServer]:
    """An HTTP server on 127.0.0.1 answering GET `routes` (404 elsewhere); its URL is url_of(server)."""
    server = RouteServer(("127.0.0.1", 0), Handler)
    server.routes, server.asked = routes, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def url_of(server: RouteServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


@contextmanager
def not_http_server() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that reads what comes and answers like Redis, not HTTP; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                conn.recv(65536)
                conn.sendall(b"-ERR unknown command 'GET', with args beginning with: '/server_info'\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (a port just bound and released)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"
