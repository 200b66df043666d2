"""Tier 3 and metadata: the NVMe-oF page store, the prefix index (in-process or Redis), RDMA transport."""

from radixtier.storage.page_store import PageLocation, PageStore, PutResult

__all__ = ["PageLocation", "PageStore", "PutResult"]
