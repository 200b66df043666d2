"""Optional RDMA transport (pyverbs): one node reads pages straight out of another node's
registered host memory with one-sided RDMA READs, no CPU on the serving side.

Each side registers a host buffer (radixtier's host page pool, or SGLang's host KV pool) as a
memory region and publishes an `Endpoint` (QP number, GID, LID, buffer address, rkey) through
any channel (the Redis index is one); `connect` brings the reliable-connected QP to RTS.
`read_page` then copies `length` bytes from the peer into the local buffer and checks the
CRC-32C the peer advertised for the page: remote memory is trusted no more than flash.

Needs the `rdma` extra (pyverbs, from rdma-core) and an RDMA device (InfiniBand, RoCE, or
soft-RoCE `rdma_rxe`). `rdma_available()` says why not where either is missing.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from radixtier.storage.checksum import checksum
from radixtier.storage.api import BufferLike, buffer_address, buffer_view


def rdma_available(device: Optional[str] = None) -> Tuple[bool, str]:
    """(usable, reason): pyverbs importable and at least one (or the named) RDMA device present."""
    try:
        from pyverbs.device import get_device_list
    except ImportError as exc:
        return False, f"pyverbs is not installed (pip install 'radixtier[rdma]'): {exc}"
    if not os.path.isdir("/sys/class/infiniband"):
        return False, "no RDMA device: /sys/class/infiniband does not exist (no IB/RoCE NIC or rdma_rxe)"
    try:
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in get_device_list()]
    except Exception as exc:  # the verbs library refusing to enumerate
        return False, f"RDMA devices cannot be listed: {exc}"
    if not names:
        return False, "no RDMA device is listed by ibv_get_device_list"
    if device is not None and device not in names:
        return False, f"RDMA device {device!r} not found (have: {', '.join(names)})"
    return True, f"RDMA devices: {', '.join(names)}"


@dataclass(frozen=True)
class Endpoint:
    """What a peer needs to read from us; small enough to publish as a record."""

    qp_num: int
    lid: int
    gid: str
    addr: int
    length: int
    rkey: int

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, object]) -> "Endpoint":
        try:
            ep = cls(int(d["qp_num"]), int(d["lid"]), str(d["gid"]), int(d["addr"]), int(d["length"]),
                     int(d["rkey"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"endpoint: malformed record {d!r}: {exc}") from None
        if ep.length <= 0 or ep.addr <= 0:
            raise ValueError(f"endpoint: address/length must be positive, got {ep.addr:#x}/{ep.length}")
        return ep


class RdmaPageTransport:
    """One RC queue pair to one peer, over a registered host buffer."""

    def __init__(self, buffer: BufferLike, device: Optional[str] = None, port: int = 1, gid_index: int = 0,
                 max_outstanding: int = 64, timeout_s: float = 2.0) -> None:
        ok, reason = rdma_available(device)
        if not ok:
            raise RuntimeError(f"RDMA transport unavailable: {reason}")
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._e = e
        if device is None:
            first = get_device_list()[0].name
            device = first.decode() if isinstance(first, bytes) else str(first)
        self.device, self.port, self.gid_index, self.timeout_s = device, port, gid_index, timeout_s
        self._view = buffer_view(buffer)  # keeps the caller's buffer alive while registered
        self.addr, self.length = buffer_address(buffer)
        self._ctx = Context(name=device)
        self._pd = PD(self._ctx)
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        self._mr = MR(self._pd, self.length, access, address=self.addr)
        self._cq = CQ(self._ctx, max_outstanding)
        cap = QPCap(max_send_wr=max_outstanding, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self._qp = QP(self._pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap))
        port_attr = self._ctx.query_port(port)
        self._lid = int(port_attr.lid)
        self._gid = self._ctx.query_gid(port, gid_index)
        self._peer: Optional[Endpoint] = None

    def endpoint(self) -> Endpoint:
        return Endpoint(self._qp.qp_num, self._lid, str(self._gid), self.addr, self.length, self._mr.rkey)

    def connect(self, peer: Endpoint) -> None:
        """INIT -> RTR -> RTS against the peer's queue pair."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self._e
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = peer.qp_num
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 16
        gr = GlobalRoute(dgid=GID(peer.gid), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
        self._qp.to_rts(attr)
        self._peer = peer

    def read_page(self, remote_offset: int, length: int, local_offset: int, expected_crc: Optional[int] = None) -> bool:
        """RDMA READ `length` bytes at the peer's buffer offset into ours; True only if it landed
        and (when given) matches the CRC-32C the peer advertised for the page."""
        from pyverbs.wr import SGE, SendWR

        e, peer = self._e, self._peer
        if peer is None:
            raise RuntimeError("read_page: connect() to a peer first")
        if not (0 <= remote_offset and remote_offset + length <= peer.length):
            raise ValueError(f"read_page: [{remote_offset}, +{length}) is outside the peer's {peer.length} bytes")
        if not (0 <= local_offset and local_offset + length <= self.length):
            raise ValueError(f"read_page: [{local_offset}, +{length}) is outside our {self.length} bytes")
        wr = SendWR(opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(self.addr + local_offset, length, self._mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(peer.rkey, peer.addr + remote_offset)
        self._qp.post_send(wr)
        deadline = time.monotonic() + self.timeout_s
        while True:
            n, wcs = self._cq.poll()
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    return False
                break
            if time.monotonic() > deadline:
                return False
        if expected_crc is not None:
            return checksum(self._view[local_offset:local_offset + length]) == expected_crc
        return True

    def close(self) -> None:
        for obj in ("_qp", "_cq", "_mr", "_pd", "_ctx"):
            o = getattr(self, obj, None)
            if o is not None:
                o.close()
                setattr(self, obj, None)
