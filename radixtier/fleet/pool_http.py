"""The pool's view over HTTP, for a router that asks instead of listening (`radixtier pool-events
--http 0.0.0.0:5601`):

    POST /fleet_view  {"block_hashes": [<SGLang's int64 block hashes of the request, in order>]}
      -> {"pool": 12, "nodes": {"tcp://node-a:5557": {"disk": 12, "external": 12}, ...}}
    GET  /stats       the stream's counters

`disk`: leading blocks the node announced in its own tier 3; `external`: leading blocks anyone holds
in the shared namespace, which every attached node can load. Hostile input is refused with 400 and
one line: a body over 8 MiB, not JSON, or block_hashes not a list of at most 65,536 integers; a
client that sends nothing for 10 s is dropped, and past 16 requests at once the rest get 503.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Tuple

from radixtier.fleet.pool_stream import PoolStream

MAX_BODY = 8 << 20
MAX_BLOCKS_ASKED = 1 << 16   # a 4M-token prompt in 64-token pages; the view holds the pool's lock while it walks
MAX_AT_ONCE = 16
INT64 = 1 << 63


def parse_listen(text: str) -> Tuple[str, int]:
    """'host:port' -> (host, port); ValueError naming --http otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http: expected HOST:PORT such as 127.0.0.1:5601, got {text[:200]!r}")
    return host.strip("[]"), int(port)


class _Handler(BaseHTTPRequestHandler):
    pool: PoolStream  # set on the subclass made by serve()
    slots: threading.BoundedSemaphore
    timeout = 10  # seconds a client may stay silent (http.server applies it to the socket)

    def log_message(self, *args: Any) -> None:  # the CLI prints its own status lines
        pass

    def _reply(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/stats":
            self._reply(200, self.pool.stats())
        else:
            self._reply(404, {"error": f"no such path {self.path[:100]!r}; try POST /fleet_view or GET /stats"})

    def do_POST(self) -> None:  # noqa: N802
        if not self.slots.acquire(blocking=False):
            self._reply(503, {"error": f"busy: more than {MAX_AT_ONCE} requests at once"})
            return
        try:
            self._fleet_view()
        finally:
            self.slots.release()

    def _fleet_view(self) -> None:
        if self.path != "/fleet_view":
            self._reply(404, {"error": f"no such path {self.path[:100]!r}; try POST /fleet_view"})
            return
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._reply(400, {"error": f"Content-Length: expected 0..{MAX_BODY} bytes"})
            return
        try:
            hashes = json.loads(self.rfile.read(length))["block_hashes"]
        except (ValueError, KeyError, TypeError, RecursionError):
            self._reply(400, {"error": "body: expected JSON {\"block_hashes\": [int, ...]}"})
            return
        if not isinstance(hashes, list) or len(hashes) > MAX_BLOCKS_ASKED or not all(
                type(h) is int and -INT64 <= h < INT64 for h in hashes):
            self._reply(400, {"error": f"block_hashes: expected a list of at most {MAX_BLOCKS_ASKED} 64-bit integers"})
            return
        self._reply(200, self.pool.view(hashes))


def serve(pool: PoolStream, listen: str) -> ThreadingHTTPServer:
    """Start answering on `listen` (HOST:PORT) in a daemon thread; shutdown() stops it."""
    host, port = parse_listen(listen)
    handler = type("PoolHandler", (_Handler,), {"pool": pool, "slots": threading.BoundedSemaphore(MAX_AT_ONCE)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="radixtier-pool-http", daemon=True).start()
    return server
