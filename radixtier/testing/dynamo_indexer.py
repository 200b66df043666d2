"""Dynamo's standalone KV indexer (`python -m dynamo.indexer`, PyPI ai-dynamo-runtime) as a test
consumer of KV events: a real router-side process nobody here wrote, subscribed over ZMQ to the
workers' streams, queried over its HTTP API (`POST /query` with a request's token ids answers, per
worker, how many leading tokens it holds: `gpu`, `cpu`, `disk`, `longest_matched`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Dict, List

from radixtier.testing.redis_server import free_port

START_S = 60.0


class DynamoIndexer:
    """One `python -m dynamo.indexer` process on a free loopback port, in its own process group;
    `workers` maps a worker id to its ZMQ PUB endpoint (tcp://127.0.0.1:port)."""

    def __init__(self, workdir: str, block_size: int, workers: Dict[int, str]) -> None:
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"dynamo-indexer-{self.port}.log")
        spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--block-size", str(block_size),
                                          "--port", str(self.port), "--threads", "1", "--workers", spec],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_S
        while True:
            try:
                self.query([0])
                return
            except (OSError, urllib.error.URLError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"dynamo.indexer did not start in {START_S:.0f} s:\n{self.log_tail()}")
                time.sleep(0.2)

    def query(self, token_ids: List[int]) -> Dict[int, Dict[str, int]]:
        """Per worker id, what Dynamo says it holds of `token_ids` (tokens): gpu, cpu, disk, longest_matched."""
        body = json.dumps({"token_ids": token_ids, "model_name": "default"}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/query", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = json.loads(resp.read())
        return {int(wid): {k: v for k, v in info.items() if isinstance(v, int)}
                for wid, info in answer.get("instances", {}).items()}

    def register(self, worker: int, endpoint: str, replay_endpoint: str, block_size: int) -> None:
        """Register a worker's KV-event stream (`POST /register`), as Dynamo's discovery does when a
        worker comes up: with a replay endpoint, a sequence gap is filled from the worker's replay
        socket (SGLang's publisher keeps its recent batches)."""
        self._post("/register", {"instance_id": worker, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
                                 "block_size": block_size, "model_name": "default"})

    def _post(self, path: str, body: dict) -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read()

    def dump(self) -> object:
        """The indexer's whole tree as Dynamo's RouterEvents (`GET /dump`)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/dump", timeout=10) as resp:
            return json.loads(resp.read())

    def wait_for(self, token_ids: List[int], check: Callable[[Dict[int, Dict[str, int]]], bool],
                 timeout: float = 20.0) -> Dict[int, Dict[str, int]]:
        """Query until `check(answer)` holds; the last answer either way (the caller asserts)."""
        deadline = time.monotonic() + timeout
        while True:
            answer = self.query(token_ids)
            if check(answer) or time.monotonic() > deadline:
                return answer
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def tokens_of(answer: Dict[int, Dict[str, int]], worker: int, tier: str) -> int:
    return answer.get(worker, {}).get(tier, 0)

