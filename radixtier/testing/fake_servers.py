"""Servers that are not Redis, on free loopback ports: an HTTP server, and a socket that answers
every connection with fixed bytes. A `redis_url` pointing at them must be a one-line error."""

from __future__ import annotations

import http.server
import socket
import threading


def http_server() -> int:
    """An HTTP server (answers GET with a directory listing); returns its port."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd.server_address[1]


def garbage_server(reply: bytes) -> int:
    """A socket that reads one request and answers `reply` to every connection; returns its port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)

    def run() -> None:
        while True:
            c, _ = s.accept()
            try:
                c.recv(4096)
                c.sendall(reply)
            except OSError:
                pass

    threading.Thread(target=run, daemon=True).start()
    return s.getsockname()[1]
