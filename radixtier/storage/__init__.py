"""The storage layer both serving paths share: tier 3 (the NVMe-oF page store) and the prefix index.

    api.py        PageStore / PrefixIndex protocols, KEY_BYTES, PageLocation, PageRecord, PutResult
    client.py     a node's tier 3: its partition, then other nodes' pages; what follows a write
    publisher.py  publish / unpublish / remote run / republish, for the cache and the SGLang backend
    nvmeof/       layout, namespace, target, lease, io engines, slots, page I/O, store, inspect
    index/        records, in-process index, Redis index
    checksum.py   the page checksum (CRC-32C) the store and the RDMA transport share
    rdma.py       optional RDMA page transport
"""

from radixtier.storage.api import PageLocation, PageRecord, PageStore, PrefixIndex, PutResult

__all__ = ["PageLocation", "PageRecord", "PageStore", "PrefixIndex", "PutResult"]
