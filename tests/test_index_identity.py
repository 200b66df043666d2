"""One node id, one live process: duplicates are refused at start, a crashed node's restart takes
its id back, and the default id tells apart containers that share a host name (real redis-server)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import redis

from radixtier import validate
from radixtier.storage.index.identity import default_node_id
from radixtier.storage.index.redis_index import RedisIndexConfig, RedisPrefixIndex

from radixtier.testing.index import index, publish_chain, rec, wait_for


def test_a_second_live_process_with_the_same_node_id_is_refused(redis_server):
    a = index(redis_server.url, "node-a")
    keys = publish_chain(a, 0, 4)
    with pytest.raises(ValueError) as err:  # a second process holding nothing: its republication would
        RedisPrefixIndex(RedisIndexConfig(url=redis_server.url, node_id="node-a", namespace="test",  # delete a's
                                          heartbeat_s=0.2, node_ttl_s=1.0), republish=lambda: iter(()))
    msg = str(err.value)
    assert msg.startswith("node_id: 'node-a' is in use by another live process") and "\n" not in msg
    assert "node_id" in msg.split(";", 1)[1]  # says how to fix it
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)  # the first node's pages were left alone
    time.sleep(0.5)
    assert len(b.lookup(keys[0], keys)) == 4
    a.close(), b.close()


def test_a_restart_after_a_crash_takes_the_node_id_back(redis_server):
    a = index(redis_server.url, "node-a")
    keys = publish_chain(a, 0, 4)
    a._stop.set()  # crash: the heartbeat stops, its key is still there for up to node_ttl_s
    a._worker.join()
    t = time.monotonic()
    a2 = index(redis_server.url, "node-a")
    assert time.monotonic() - t < a2.config.node_ttl_s + 1.0
    a2.set_republisher(lambda: iter([(keys[0], key, rec("node-a", i)) for i, key in enumerate(keys)]))
    b = index(redis_server.url, "node-b")
    assert wait_for(lambda: len(b.lookup(keys[0], keys)) == 4)
    assert not a2.health()["duplicate_node_id"]
    a2.close(), b.close()


def test_a_clean_restart_does_not_wait(redis_server):
    a = index(redis_server.url, "node-a")
    a.close()  # says goodbye: its heartbeat key is gone
    t = time.monotonic()
    index(redis_server.url, "node-a").close()
    assert time.monotonic() - t < 0.5


def test_two_processes_starting_together_with_one_node_id_one_is_refused(redis_server):
    out, lock = [], threading.Lock()

    def start() -> None:
        try:
            ix = index(redis_server.url, "node-a")
            with lock:
                out.append(ix)
        except ValueError as exc:
            with lock:
                out.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=10) for t in threads]
    errors = [x for x in out if isinstance(x, ValueError)]
    assert len(out) == 2 and len(errors) == 1, out
    assert str(errors[0]).startswith("node_id: 'node-a' is in use")
    [x.close() for x in out if not isinstance(x, ValueError)]


def test_a_duplicate_that_slipped_in_shows_in_health_and_logs_once(redis_server, caplog):
    """Redis was unreachable when the second one started (no check possible): the running node
    finds another process's token in its heartbeat and says so, once, not on every beat."""
    a = index(redis_server.url, "node-a")
    raw = redis.Redis.from_url(redis_server.url)
    caplog.set_level(logging.WARNING, logger="radixtier.storage.redis")
    stop = threading.Event()

    def other_process() -> None:  # another process beating as node-a
        while not stop.is_set():
            raw.set(a._keys.node("node-a"), f"node-a|{time.time():.3f}|intruder", px=1000)
            stop.wait(0.05)

    t = threading.Thread(target=other_process)
    t.start()
    try:
        assert wait_for(lambda: a.health()["duplicate_node_id"], timeout=5)
        time.sleep(1.0)
    finally:
        stop.set()
        t.join()
    assert "node_id: 'node-a'" in a.health()["duplicate_node_id"]
    assert len([r for r in caplog.records if "node_id" in r.getMessage()]) == 1
    a.close()


def _fake_machine(tmp_path, name: str, hostname: str, machine_id: str = "", cgroup: str = "0::/\n",
                  mountinfo: str = "") -> str:
    root = tmp_path / name
    for rel, text in (("etc/hostname", hostname + "\n"), ("etc/machine-id", machine_id),
                      ("proc/self/cgroup", cgroup), ("proc/self/mountinfo", mountinfo)):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if text:
            p.write_text(text)
    return str(root)


def _docker_mountinfo(container: str) -> str:
    return (f"612 540 0:52 / / rw,relatime master:290 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/AB:"
            f"/var/lib/docker/overlay2/l/CD,upperdir=/var/lib/docker/overlay2/{container[::-1]}/diff,workdir=x\n"
            f"630 612 254:1 /var/lib/docker/containers/{container}/hostname /etc/hostname rw,relatime - ext4 "
            f"/dev/vda1 rw\n")


def test_the_default_node_id_tells_apart_containers_that_share_a_host_name(tmp_path):
    c1, c2 = "a1" * 32, "b2" * 32
    same_host = dict(hostname="gpu-node-7", machine_id="3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    one = default_node_id(root=_fake_machine(tmp_path, "c1", mountinfo=_docker_mountinfo(c1), **same_host))
    two = default_node_id(root=_fake_machine(tmp_path, "c2", mountinfo=_docker_mountinfo(c2), **same_host))
    again = default_node_id(root=_fake_machine(tmp_path, "c1b", mountinfo=_docker_mountinfo(c1), **same_host))
    v1 = default_node_id(root=_fake_machine(tmp_path, "v1", cgroup=f"12:memory:/docker/{c1}\n", **same_host))
    v2 = default_node_id(root=_fake_machine(tmp_path, "v2", cgroup=f"12:memory:/docker/{c2}\n", **same_host))
    assert one.startswith("gpu-node-7-") and two.startswith("gpu-node-7-")
    assert one != two and v1 != v2  # two containers, one host name
    assert one == again  # the same container after a restart: the same id, so it finds its own pages


def test_the_default_node_id_is_valid_and_fits_a_rank_suffix(tmp_path):
    long_host = "h" * 63
    nid = default_node_id(root=_fake_machine(tmp_path, "long", hostname=long_host))
    assert len(nid.encode()) <= validate.NODE_ID_MAX_BYTES - 8  # room for ".r<rank>"
    validate.node_id("node_id", nid + ".r7")
    odd = default_node_id(root=_fake_machine(tmp_path, "odd", hostname="we:ird{host}"))
    validate.node_id("node_id", odd)
    bare = default_node_id(root=_fake_machine(tmp_path, "bare", hostname=""))
    validate.node_id("node_id", bare)


def test_the_default_node_id_is_stable_across_processes_and_is_the_index_default():
    code = "from radixtier.storage.index.identity import default_node_id; print(default_node_id())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == default_node_id()
    assert RedisIndexConfig().node_id == default_node_id()
