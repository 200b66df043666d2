"""Start and stop real SGLang servers (`sglang.launch_server`) with radixtier as their L3 backend.

The demo, the real-server tests and `bench/sglang_server.py` all go through `SGLangServer`, so
they run exactly what an operator runs: SGLang's HTTP server, its scheduler and detokenizer
processes, the plugin entry point in each. A server is started on a free loopback port, in a
process group of its own (stopping it stops every process SGLang spawned), with a bounded
start-up time; its log goes to a file, and the tail of that log is in the error when it fails
to start.

On a machine without CUDA the server runs through `cpu_server` (the CPU support layer) with
SGLang's CPU flags (`CPU_ARGS`) and the model computing in the CPU's native dtype
(`radixtier.native_dtype`: bf16 with AVX-512 BF16 or AMX, fp32 elsewhere); with CUDA it is
`python -m sglang.launch_server` as it is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

import requests

from radixtier.integrations.sglang.launch.plugin import backend_extra_config
from radixtier.native_dtype import resolve_dtype
from radixtier.ports import free_port

# SGLang's CPU path (facts: shared/sglang-0.5.23-on-cpu.md): torch attention, no server warm-up
# (the first request is the warm-up), L1<->L2 copies by the `direct` io backend.
CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup")
HICACHE_IO_BACKEND = {"cpu": "direct", "cuda": "kernel"}
_LOG_NOISE = ("Ignore import error when loading",)  # SGLang probes every model file at start


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in this (main) thread, so the `finally` and `with` blocks that stop
    servers run: they live in process groups of their own and would outlive a killed launcher."""
    def raise_exit(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log's tail."""


def hicache_args(*, extra_config: Optional[Mapping[str, Any]], backend: str = "dynamic", ratio: float = 2.0,
                 layout: str = "page_first_direct", write_policy: str = "write_through",
                 prefetch_policy: str = "wait_complete", device: str = "cpu") -> List[str]:
    """SGLang's hierarchical-cache flags: L2 at `ratio` x L1, and an L3 backend (None: no L3).

    `wait_complete` is the default here because SGLang's own default, `best_effort`, lets the
    scheduler cut a prefetch short before its read lands on a lightly loaded server (README).
    """
    args = ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio), "--hicache-mem-layout", layout,
            "--hicache-io-backend", HICACHE_IO_BACKEND[device], "--hicache-write-policy", write_policy]
    if backend:
        args += ["--hicache-storage-backend", backend, "--hicache-storage-prefetch-policy", prefetch_policy]
        if extra_config is not None:
            args += ["--hicache-storage-backend-extra-config", json.dumps(dict(extra_config))]
    return args


def radixtier_args(path: str, *, capacity: str = "256MiB", node_id: str = "node-a", ratio: float = 2.0,
                   layout: str = "page_first_direct", write_policy: str = "write_through",
                   prefetch_policy: str = "wait_complete", device: str = "cpu", **keys: Any) -> List[str]:
    """Flags for radixtier as the L3 backend on namespace `path` (created with `capacity` if missing)."""
    extra = backend_extra_config(path=path, capacity=capacity, node_id=node_id, **keys)
    return hicache_args(extra_config=extra, ratio=ratio, layout=layout, write_policy=write_policy,
                        prefetch_policy=prefetch_policy, device=device)


class SGLangServer:
    """One `sglang.launch_server` process group on a loopback port.

    Use as a context manager, or call start() and stop(). `kill()` sends SIGKILL to every process
    of the server at once (a crash); `restart()` starts it again with the same flags and port.
    """

    def __init__(self, model_path: str, args: Sequence[str] = (), *, log_path: str, device: str = "cpu",
                 port: Optional[int] = None, host: str = "127.0.0.1", env: Optional[Mapping[str, str]] = None,
                 startup_timeout_s: float = 240.0, python: str = sys.executable, dtype: str = "auto") -> None:
        """dtype: what the model computes in on the CPU (`auto`: the CPU's native dtype, see
        radixtier.native_dtype; ignored with device cuda or when args carry --dtype)."""
        if device not in HICACHE_IO_BACKEND:
            raise ValueError(f"device: expected cpu or cuda, got {device!r}")
        self.dtype, self.dtype_reason = resolve_dtype(dtype) if device == "cpu" else ("auto", "SGLang's choice")
        self.model_path, self.args, self.device = model_path, list(args), device
        self.host, self.port = host, port or free_port(host)
        self.log_path, self.startup_timeout_s, self.python = log_path, startup_timeout_s, python
        self.env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> List[str]:
        launcher = "radixtier.integrations.sglang.cpu_server" if self.device == "cpu" else "sglang.launch_server"
        cmd = [self.python, "-m", launcher, "--model-path", self.model_path, "--host", self.host,
               "--port", str(self.port)]
        if self.device == "cpu":
            cmd += CPU_ARGS
            if "--dtype" not in self.args:
                cmd += ["--dtype", self.dtype]
        return cmd + self.args

    # ---------------------------------------------------------------- life cycle
    def start(self) -> "SGLangServer":
        """Start and wait until /health answers; ServerStartError (with the log's tail) otherwise."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"server on port {self.port} is already running")
        env = {**os.environ, **self.env}
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(t0 + self.startup_timeout_s)
            self.startup_s = time.monotonic() - t0
            self._post("/freeze_gc")  # SGLang's own post-warm-up freeze races the listener when warm-up is skipped
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(f"SGLang server exited with status {rc} during start-up\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"SGLang server did not answer /health within {self.startup_timeout_s:.0f} s"
                                       f"\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group; SIGKILL for what is left once SGLang's workers have exited
        (or after timeout_s). SGLang 0.5.23's scheduler and detokenizer die on SIGTERM at once; its
        launcher then sleeps 5 s "to let GPU activity settle" before it exits, which a server that
        has no worker left gains nothing from."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a paused server acts on its SIGTERM once it runs again
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline and self._workers_alive():
            time.sleep(0.05)
        self._signal_group(signal.SIGKILL)  # the launcher, and SGLang's children should any outlive it
        self.proc.wait()

    def _workers_alive(self) -> bool:
        """Whether a process of the server's group other than the launcher, named `sglang::...` as
        SGLang names its scheduler and detokenizer processes, is still running (not a zombie)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # gone meanwhile
            name_end = stat.rfind(")")
            name, fields = stat[stat.find("(") + 1:name_end], stat[name_end + 2:].split()
            if len(fields) > 2 and fields[2] == str(self.proc.pid) and fields[0] != "Z" and name.startswith("sglang::"):
                return True
        return False

    def kill(self) -> None:
        """SIGKILL every process of the server at once, as a crash or an OOM kill of the node would."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP) until resume(). An idle SGLang scheduler polls
        its sockets without sleeping and keeps a core busy; a paused one takes no CPU, so another
        server can be measured beside it. Requests sent meanwhile wait in the socket."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT); a no-op on a running one."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGCONT)

    def warm_up(self, tokens: int = 1024) -> None:
        """One greedy request of about `tokens` random token ids (sharing no prefix with real
        traffic): torch's first-run costs (kernel selection for these shapes, allocator growth) land
        here rather than in the first measured request (the servers start with --skip-server-warmup)."""
        import random

        rng = random.Random(7)
        ids = [rng.randrange(32, 90) for _ in range(tokens)]
        self._post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
                   timeout=300)

    def restart(self) -> "SGLangServer":
        self.stop()
        return self.start()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session: the group id is the server's pid
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SGLangServer":
        """Starts the server unless it already runs (e.g. started by start_together); stopped on exit."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- HTTP
    def _post(self, route: str, payload: Optional[Dict[str, Any]] = None, timeout: float = 120.0):
        r = requests.post(self.url + route, json=payload, timeout=timeout)
        r.raise_for_status()
        return r

    def flush_cache(self, timeout_s: float = 30.0) -> None:
        """Empty SGLang's device and host tiers (tier 3 keeps its pages). SGLang refuses (400) while
        work is pending -- a hybrid's state copies can still be in flight after the last reply --
        so a refusal is asked again until `timeout_s`, then raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._post("/flush_cache")
                return
            except requests.HTTPError as exc:
                if exc.response is None or exc.response.status_code != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def metrics(self) -> str:
        return requests.get(self.url + "/metrics", timeout=10).text

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        kept = [ln[:400] for ln in text if not any(n in ln for n in _LOG_NOISE)]  # server_args= is one huge line
        return f"--- last {min(lines, len(kept))} lines of {self.log_path}\n" + "\n".join(kept[-lines:])


def start_together(servers: Sequence[SGLangServer]) -> None:
    """Start several servers at once (their start-ups are mostly imports, which two cores share
    better than one start-up uses them); when one fails, every one is stopped and its error raised."""
    import threading

    errors: List[BaseException] = []

    def start(s: SGLangServer) -> None:
        try:
            s.start()
        except BaseException as exc:  # noqa: BLE001 -- re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
