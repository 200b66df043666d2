"""Drive SGLang 0.5.23's own cache code on the CPU with radixtier attached as its L3 backend.

SGLang's scheduler owns a `UnifiedRadixCache`; `init_hicache()` builds the host pool and a
`HybridCacheController`, which attaches the backend through `StorageBackendFactory` ("dynamic")
and calls it from its own prefetch and backup threads. `SGLangNode` builds exactly that, from
real `ServerArgs`, `ReqToTokenPool`, `MHATokenToKVPool` and `PagedTokenToKVPoolAllocator`, and
offers the scheduler's steps in the scheduler's order (allocation with eviction, insert,
`check_hicache_events`, `prefetch_from_storage` with the arguments `Scheduler._prefetch_kvcache`
passes, `check_prefetch_progress`, `init_load_back`, load to device).

On the CPU, SGLang's L1<->L2 copy ops and pinned host pool need radixtier's CPU support layer
(`radixtier.integrations.sglang.launch.cpu_support`, the same patches the real server runs with here);
`ServerArgs(model_path="dummy")` skips argument resolution, so its hicache step (`handle_hicache`)
is run here, and the parallel state is stated (tp = pp = 1) since no process group exists.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from array import array
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.arg_groups.hicache_hook import handle_hicache
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocation import alloc_token_slots
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import (CacheRequestHandle, InitLoadBackParams, InsertParams,
                                                    MatchPrefixParams)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.runtime_context import get_parallel
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from radixtier.integrations.sglang.launch import cpu_support


class SGLangNode:
    """One SGLang scheduler's cache (L1 + L2 by SGLang, L3 = radixtier), driven step by step."""

    def __init__(self, extra: Dict[str, object], *, layout: str, write_policy: str = "write_through",
                 prefetch_policy: str = "wait_complete", page_size: int = 16, layers: int = 4, heads: int = 2,
                 head_dim: int = 64, device_tokens: int = 512, host_ratio: float = 2.0,
                 prefetch_timeout_s: Optional[float] = None, storage_backend: str = "dynamic",
                 storage_env: Optional[Dict[str, str]] = None, mla: bool = False) -> None:
        """extra: radixtier's extra_config keys (storage_backend "dynamic"), or another SGLang
        backend's own extra_config (e.g. "file", "nixl"; their directories come from storage_env)."""
        cpu_support.install()
        self.page_size, self.layers, self.heads, self.head_dim = page_size, layers, heads, head_dim
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
        self.req_to_token = ReqToTokenPool(size=16, max_context_len=4096, device="cpu", enable_memory_saver=False)
        self.mla = mla
        if mla:  # one latent buffer per layer: kv_lora_rank = head_dim, rope dim 16
            self.kv = MLATokenToKVPool(device_tokens, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=head_dim,
                                       qk_rope_head_dim=16, layer_num=layers, device="cpu", enable_memory_saver=False,
                                       start_layer=0, end_layer=layers)
        else:
            self.kv = MHATokenToKVPool(device_tokens, page_size=page_size, dtype=torch.bfloat16, head_num=heads,
                                       head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                                       start_layer=0, end_layer=layers, enable_alt_stream=False)
        self.allocator = PagedTokenToKVPoolAllocator(device_tokens, page_size=page_size, dtype=torch.bfloat16,
                                                     device="cpu", kvcache=self.kv, need_sort=False)
        params = CacheInitParams(req_to_token_pool=self.req_to_token, token_to_kv_pool_allocator=self.allocator,
                                 page_size=page_size, disable=False, tree_components=(ComponentType.FULL,))
        self.cache = UnifiedRadixCache(params=params)
        if storage_backend == "dynamic":
            backend = {"backend_name": "radixtier", "module_path": "radixtier.integrations.sglang",
                       "class_name": "RadixTierStorage", "interface_v1": 1, "hicache_storage_pass_prefix_keys": True,
                       "prefetch_threshold": 1, **extra}
        else:
            backend = {"prefetch_threshold": 1, **extra}
        os.environ.update(storage_env or {})
        if prefetch_timeout_s is not None:  # SGLang's timeout policy: base + per 1K tokens
            backend.update(prefetch_timeout_base=prefetch_timeout_s, prefetch_timeout_per_ki_token=0.0)
        args = ServerArgs(model_path="dummy", page_size=page_size, hicache_io_backend="direct",
                          hicache_mem_layout=layout, hicache_write_policy=write_policy,
                          hicache_storage_backend=storage_backend,
                          hicache_storage_backend_extra_config=json.dumps(backend),
                          hicache_storage_prefetch_policy=prefetch_policy, hicache_ratio=host_ratio)
        handle_hicache(args)  # shim 3: what the argument pipeline would do
        self.layout = args.hicache_mem_layout
        set_global_server_args_for_scheduler(args)
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
            self.cache.init_hicache(args, params)
        atexit.unregister(self.cache.shutdown)
        self.backend = self.cache.cache_controller.storage_backend
        self._rid = 0

    # ---------------------------------------------------------------- KV contents
    def _layer_buffers(self) -> List[List[torch.Tensor]]:
        """Per layer, the device tensors holding its KV: [K, V] (MHA) or [latent] (MLA)."""
        if self.mla:
            return [[self.kv.kv_buffer[layer]] for layer in range(self.layers)]
        return [[self.kv.k_buffer[layer], self.kv.v_buffer[layer]] for layer in range(self.layers)]

    def fill(self, indices: torch.Tensor, seed: int) -> Tuple[torch.Tensor, ...]:
        """Random KV for these token slots in every layer; returns them (see snapshot)."""
        g = torch.Generator().manual_seed(seed)
        for bufs in self._layer_buffers():
            for buf in bufs:
                shape = (len(indices),) + tuple(buf.shape[1:])
                buf[indices] = torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
        return self.snapshot(indices)

    def snapshot(self, indices: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """KV of these token slots, one int16 tensor [layers, tokens, ...] per buffer kind (K, V or latent)."""
        per_layer = self._layer_buffers()
        return tuple(torch.stack([bufs[b][indices] for bufs in per_layer]).view(torch.int16).clone()
                     for b in range(len(per_layer[0])))

    # ---------------------------------------------------------------- the scheduler's steps
    def match(self, tokens: List[int]):
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))

    def insert(self, tokens: List[int], seed: int) -> Tuple[torch.Tensor, ...]:
        """Prefill a request: its slots come from SGLang's allocation path (evicting under pressure),
        its KV is written, and it is cached; returns the KV written for its new tokens."""
        cached, slots, kv = self.prefill(tokens, seed)
        self.cache_request(tokens, cached, slots)
        return kv

    def prefill(self, tokens: List[int], seed: int) -> Tuple[int, torch.Tensor, Tuple[torch.Tensor, ...]]:
        """Allocate the request's new tokens (SGLang's alloc_token_slots) and write their KV."""
        cached = self.match(tokens).device_prefix_len
        slots = alloc_token_slots(self.cache, len(tokens) - cached)
        return cached, slots, self.fill(slots, seed)

    def cache_request(self, tokens: List[int], cached: int, slots: torch.Tensor) -> None:
        """What the scheduler does when a prefill finishes: insert into the tree (write-through starts)."""
        prefix = self.cache.path_device_indices(self.match(tokens).last_device_node)[:cached]
        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=torch.cat([prefix, slots]),
                                       prev_prefix_len=cached))  # the matched prefix is the tree's, not new
        self.step()

    def step(self) -> None:
        self.cache.check_hicache_events()

    def pump(self, cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Step the cache every 1 ms until cond() holds (an idle scheduler loop steps about as often)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if cond():
                return
            time.sleep(0.001)
        raise AssertionError(f"{what} did not happen within {timeout} s")

    def settle_backups(self) -> None:
        """Let every write-through / backup reach L3 (the controller's backup thread, then its ack)."""
        self.pump(lambda: not self.cache.ongoing_backup and not self.cache.ongoing_write_through,
                  "L2->L3 backups")

    def prefetch(self, tokens: List[int]) -> int:
        """What Scheduler._prefetch_kvcache does for a new request; returns tokens loaded into L2."""
        m = self.match(tokens)
        anchor = m.last_host_node
        matched = m.device_prefix_len + m.host_hit_length
        prefix_keys = (self.cache.get_prefix_hash_values(anchor) if self.cache.hicache_storage_pass_prefix_keys
                       else None)
        self._rid += 1
        handle = CacheRequestHandle(f"r{self._rid}", 0)
        self.cache.prefetch_from_storage(handle, anchor, array("q", tokens[matched:]),
                                         self.cache.get_last_hash_value(anchor), prefix_keys,
                                         matched_prefix_tokens=array("q", tokens[:matched]))
        self.pump(lambda: self.cache.check_prefetch_progress(handle), "prefetch")
        return self.cache.pop_prefetch_loaded_tokens(handle)

    def load_to_device(self, tokens: List[int]) -> int:
        """init_load_back for a request with an L2 hit, then the batch's load; returns device prefix tokens."""
        m = self.match(tokens)
        if m.host_hit_length:
            req = Req(rid=f"load{self._rid}", origin_input_text="", origin_input_ids=array("q", tokens),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
            self.req_to_token.alloc([req])
            req.prefix_len, req.last_node, req.last_host_node = m.device_prefix_len, m.last_device_node, m.last_host_node
            req.best_match_node, req.host_hit_length = m.best_match_node, m.host_hit_length
            req.swa_host_hit_length, req.mamba_host_hit_length = m.swa_host_hit_length, m.mamba_host_hit_length
            self.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                         host_hit_length=m.host_hit_length, req=req))
            self.cache.ready_to_load_host_cache()
            want = m.device_prefix_len + m.host_hit_length
            self.pump(lambda: self.match(tokens).device_prefix_len >= want, "load to device")
            self.req_to_token.free(req)
        return self.match(tokens).device_prefix_len

    def device_kv(self, tokens: List[int], start: int, end: int) -> Tuple[torch.Tensor, ...]:
        indices = self.cache.path_device_indices(self.match(tokens).last_device_node)[start:end]
        return self.snapshot(indices)

    def evict_all(self) -> None:
        """Push every unlocked page out of L1 and L2 (SGLang's own evict / evict_host)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.allocator.size))
        self.step()
        self.cache.evict_host(self.cache.cache_controller.mem_pool_host.size)
        self.step()

    def close(self) -> None:
        self.cache.shutdown()
        close = getattr(self.backend, "close", None)  # SGLang's own backends may not have one
        if close is not None:
            close()
