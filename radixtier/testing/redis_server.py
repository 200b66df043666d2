"""Real redis-server processes on free loopback ports, which tests can kill and restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional

from radixtier import ports


def free_port(cluster: bool = False) -> int:
    """A free loopback port (radixtier.ports); for cluster nodes also its bus port (port + 10000)."""
    return ports.free_port(also_free=(lambda p: p + 10000 < 65536 and ports.is_free(p + 10000)) if cluster else None)


class RedisServer:
    def __init__(self, workdir: str, extra: Optional[List[str]] = None, port: Optional[int] = None,
                 tls: Optional[dict] = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh --test installs it)")
        self.exe, self.workdir, self.extra = exe, workdir, list(extra or [])
        self.port = port or free_port(cluster="--cluster-enabled" in self.extra)
        self.tls = tls
        self.proc: Optional[subprocess.Popen] = None
        os.makedirs(workdir, exist_ok=True)
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self.workdir,
                "--daemonize", "no", "--logfile", os.path.join(self.workdir, f"redis-{self.port}.log")]
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        self.proc = subprocess.Popen(args + self.extra, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()[-500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start listening")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # also ends a paused (SIGSTOPped) server
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server still accepts connections (the kernel does) but answers nothing: a "slow" Redis."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Paused for the block, resumed whatever happens (a stopped server would hang the other tests)."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()


def start_cluster(workdir: str, nodes: int = 3, replicas: int = 0) -> "List[RedisServer]":
    """A real Redis Cluster of `nodes` masters, each with `replicas` replicas, on loopback (needs
    redis-cli); the masters come first in the list. stop() each when done. With replicas a master
    is failed over after 1 s without an answer (cluster-node-timeout), so tests can kill one."""
    import redis

    servers: List[RedisServer] = []
    try:
        for i in range(nodes * (1 + replicas)):
            d = os.path.join(workdir, f"c{i}")
            servers.append(RedisServer(d, extra=["--cluster-enabled", "yes", "--cluster-config-file",
                                                 os.path.join(d, "nodes.conf"), "--cluster-node-timeout", "1000"]))
        out = subprocess.run(["redis-cli", "--cluster", "create"] + [f"127.0.0.1:{s.port}" for s in servers]
                             + ["--cluster-replicas", str(replicas), "--cluster-yes"], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout} {out.stderr}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [redis.Redis(port=s.port).info("replication") for s in servers]
            if all(redis.Redis(port=s.port).execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                   for s in servers) and all(i["role"] == "master" or i.get("master_link_status") == "up"
                                             for i in infos):
                masters = [s for s, i in zip(servers, infos) if i["role"] == "master"]
                return masters + [s for s in servers if s not in masters]
            time.sleep(0.1)
        raise RuntimeError("Redis Cluster did not reach state ok")
    except BaseException:
        for s in servers:
            s.stop()
        raise
