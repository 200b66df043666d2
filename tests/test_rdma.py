"""The RDMA transport: a real loopback read where an RDMA device exists, else a stated skip."""

from __future__ import annotations

import pytest
import torch

from radixtier.storage.checksum import checksum
from radixtier.storage.rdma import Endpoint, RdmaPageTransport, rdma_available

OK, REASON = rdma_available()


def test_availability_reports_a_reason():
    assert isinstance(OK, bool) and REASON  # never a silent "no"


def test_endpoint_records_are_validated():
    ep = Endpoint(7, 1, "fe80::1", 0x1000, 4096, 42)
    assert Endpoint.from_dict(ep.to_dict()) == ep
    with pytest.raises(ValueError, match="endpoint"):
        Endpoint.from_dict({"qp_num": 1})
    with pytest.raises(ValueError, match="endpoint"):
        Endpoint.from_dict({**ep.to_dict(), "length": 0})


def test_transport_refuses_to_start_without_rdma():
    if OK:
        pytest.skip("an RDMA device is present: the refusal path does not apply")
    with pytest.raises(RuntimeError, match="RDMA transport unavailable"):
        RdmaPageTransport(torch.zeros(1024, dtype=torch.uint8))


@pytest.mark.skipif(not OK, reason=f"needs an RDMA device and pyverbs: {REASON}")
def test_loopback_read_is_byte_exact_and_checked():
    src = torch.arange(64 * 1024, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    a, b = RdmaPageTransport(src), RdmaPageTransport(dst)
    try:
        a.connect(b.endpoint())
        b.connect(a.endpoint())
        page = src[4096:8192].numpy().tobytes()
        assert b.read_page(4096, 4096, 0, expected_crc=checksum(page))
        assert dst[:4096].numpy().tobytes() == page
        assert not b.read_page(8192, 4096, 0, expected_crc=checksum(page))  # other bytes: rejected
    finally:
        a.close()
        b.close()
