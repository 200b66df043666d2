"""The storage layer both serving paths share: tier 3 (the NVMe-oF page store) and the prefix index.

    api.py        PageStore / PrefixIndex protocols, PageLocation, PageRecord, PutResult
    validate.py   shared value checks (node ids, sizes, seconds, modes)
    publisher.py  publish / unpublish / remote run / republish, for the cache and the SGLang backend
    nvmeof/       layout, target, lease, io engines, store, inspect, eviction order
    index/        records, in-process index, Redis index
    rdma.py       optional RDMA page transport
"""

from radixtier.storage.api import PageLocation, PageRecord, PageStore, PrefixIndex, PutResult

__all__ = ["PageLocation", "PageRecord", "PageStore", "PrefixIndex", "PutResult"]
