"""SGLang 0.5.23's host KV pools and storage factory, set up as SGLang sets them up, on the CPU.

For the plugin's tests, the hostile-input tests, and their subprocesses: a host pool with random
bf16 contents (`make_host_pool`), the storage config SGLang builds from `--hicache-storage-backend
dynamic` (`storage_config`), a backend attached the way SGLang attaches it (`attach`), chains of
SGLang-style page keys, and a pool fenced by guard bytes (`Guarded`) to prove nothing is written
outside it. Needs SGLang.
"""

from __future__ import annotations

import hashlib

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from radixtier.integrations.sglang.backend.radixtier_storage import RadixTierStorage

PAGE = 16  # tokens per page of every pool made here
GUARD_BYTE = 0x5A
GUARD_PAGES = 4  # guard on each side of the pool, in whole pages of the pool (K and V of every layer)


class PageFirstOnlyHost(MHATokenToKVPoolHost):
    """Like SGLang's mamba/DSA host pools: the zero-copy walk raises outside page_first layouts."""

    def get_page_buffer_meta(self, indices):
        if self.layout != "page_first":
            raise ValueError(f"Unsupported layout: {self.layout}")
        return super().get_page_buffer_meta(indices)


def make_host_pool(layout: str, seed: int = 0, layers: int = 4, cls=MHATokenToKVPoolHost) -> MHATokenToKVPoolHost:
    dev = MHATokenToKVPool(256, PAGE, torch.bfloat16, 2, 64, layers, "cpu", False,
                           start_layer=0, end_layer=layers, enable_alt_stream=False)
    host = cls(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
               pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
               start_layer=0, end_layer=layers, write_back_staging=dev.hicache_write_back_staging)
    g = torch.Generator().manual_seed(seed)
    host.kv_buffer.view(torch.int16).copy_(torch.randint(-30000, 30000, host.kv_buffer.shape, generator=g,
                                                         dtype=torch.int16))
    return host


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, layout: str = "page_first",
                   pp_rank: int = 0, pp_size: int = 1, dp_rank: int = 0) -> HiCacheStorageConfig:
    base = {"backend_name": "radixtier", "module_path": "radixtier.integrations.sglang",
            "class_name": "RadixTierStorage"}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name="org/test-model",
                                dp_rank=dp_rank, extra_config={**base, **extra})


def attach(host, extra: dict, **kw) -> RadixTierStorage:
    """What SGLang does: build through the factory (pool not passed), then register the pools."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=host.layout, **kw), host)
    backend.register_mem_pool_host(host)
    backend.register_mem_host_pool_v2(host, PoolName.KV)
    backend.on_host_pools_registered()
    return backend


def chain_keys(n: int, seed: str = "s") -> list:
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(f"{prev}/{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def slots(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_bytes(host, page: int) -> bytes:
    return host.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()  # random bf16 bits hold NaNs


def scramble(host, first_page: int, n: int) -> None:
    for p in range(first_page, first_page + n):
        host.set_from_flat_data_page(p * PAGE, torch.zeros_like(host.get_dummy_flat_data_page()))


def attach_with_sidecar(host, side, name, extra: dict, **kw) -> RadixTierStorage:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=host.layout, **kw), host)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    b.register_mem_host_pool_v2(side, name)
    b.on_host_pools_registered()
    return b


class Guarded:
    """A host pool whose kv_buffer is the middle of a larger tensor: guard bytes before and after it.

    SGLang's zero-copy walk addresses slot s as kv_buffer.data_ptr() + s * stride, so a slot past
    the pool lands in the back guard and a negative one in the front guard, memory this test owns
    and can check, instead of the allocator's."""

    def __init__(self, layout: str, seed: int = 0, layers: int = 4) -> None:
        self.host = make_host_pool(layout, seed=seed, layers=layers)
        inner = self.host.kv_buffer
        self.n = inner.numel()
        self.g = GUARD_PAGES * (self.n // self.host.size) * PAGE
        self.backing = torch.empty(self.g + self.n + self.g, dtype=inner.dtype)
        self.backing.view(torch.uint8).fill_(GUARD_BYTE)
        self.backing[self.g:self.g + self.n].copy_(inner.reshape(-1))
        self.host.kv_buffer = self.backing[self.g:self.g + self.n].view(inner.shape)

    def snapshot(self) -> torch.Tensor:
        return self.backing.view(torch.uint8).clone()

    def guards_intact(self) -> bool:
        raw = self.backing.view(torch.uint8)
        width = self.g * self.backing.element_size()
        return bool((raw[:width] == GUARD_BYTE).all()) and bool((raw[-width:] == GUARD_BYTE).all())

    def unchanged_since(self, before: torch.Tensor) -> bool:
        return torch.equal(self.backing.view(torch.uint8), before)
