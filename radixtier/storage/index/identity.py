"""Who a node is in the index: its default id, and the token of one process start.

Why a discriminator after the host name: containers that share a host name (host networking,
`--hostname` reused by a deployment template) all defaulted to the same id; each then found none
of the other's pages (lookups skip the caller's own id) and a restart's republication deleted the
other's records. The default is therefore `<host>-<8 hex>`, the hex a hash of what tells this
machine and this container apart and stays the same when the server restarts (a restarted node
must keep its id to find its own pages again, so nothing random goes into it):

- the machine id (/etc/machine-id, else /var/lib/dbus/machine-id): one per installed system;
- the container id: a 64-hex id in /proc/self/cgroup (cgroup v1, or v2 seen from the host's
  cgroup namespace: docker, containerd, CRI-O), else in what is mounted on / and /etc/hostname
  in /proc/self/mountinfo (docker's container folder, its overlay upper layer). Only those two
  mounts are read: on a host, the mount table lists other containers' mounts, which come and go.

The token (random per process start) travels in the node's heartbeat: a heartbeat renewed with
another token than ours is another live process using our id (see redis_liveness.Heartbeat.claim).
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from typing import Optional

from radixtier import validate

DEFAULT_ID_BYTES = validate.NODE_ID_MAX_BYTES - 8  # room for the SGLang plugin's ".r<rank>" suffix
_CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._-]")


def _read(root: str, path: str) -> str:
    """A small system file's text under `root` ("" where absent or unreadable)."""
    try:
        with open(os.path.join(root, path.lstrip("/")), "rb") as f:
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def container_id(root: str = "/") -> str:
    """This container's id (64 hex digits), or "" outside a container (see the module docstring)."""
    found = _CONTAINER_ID.search(_read(root, "proc/self/cgroup"))
    if found:
        return found.group(0)
    for line in _read(root, "proc/self/mountinfo").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] in ("/", "/etc/hostname"):
            found = _CONTAINER_ID.search(line)
            if found:
                return found.group(0)
    return ""


def machine_id(root: str = "/") -> str:
    for path in ("etc/machine-id", "var/lib/dbus/machine-id"):
        text = _read(root, path).strip()
        if text:
            return text
    return ""


def host_name(root: str = "/") -> str:
    """The host name's first label, reduced to what a node id may hold ("node" when empty)."""
    name = socket.gethostname() if root == "/" else _read(root, "etc/hostname").strip()
    name = _NOT_IN_ID.sub("-", name.split(".")[0]).strip("-")
    return name or "node"


def default_node_id(root: str = "/", max_bytes: int = DEFAULT_ID_BYTES) -> str:
    """`<host>-<8 hex>`: the same across restarts of this server, different for another machine
    or container with the same host name. `root` is where the system files are read (tests)."""
    material = f"{machine_id(root)}|{container_id(root)}"
    tag = hashlib.blake2b(material.encode(), digest_size=4).hexdigest()
    return f"{host_name(root)[:max_bytes - len(tag) - 1]}-{tag}"


def instance_token() -> str:
    """Random per process start (and per index object): tells two live holders of one id apart."""
    return f"{uuid.uuid4().hex[:12]}.{os.getpid()}@{host_name()[:24]}"


def beat_payload(node: str, token: str, now: float) -> str:
    """A heartbeat's value: node|unix time|token (`index status` reads the time)."""
    return f"{node}|{now:.3f}|{token}"


def beat_token(payload: Optional[bytes]) -> Optional[str]:
    """The token of a heartbeat value, or None when it is absent or not one of ours."""
    if payload is None:
        return None
    parts = payload.decode("utf-8", "replace").rsplit("|", 2)
    return parts[2] if len(parts) == 3 else None
