"""SGLang 0.5.23's HiCacheFile backend (one file per page, serial readinto) on the same page bytes."""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time

import torch


def build_hicachefile(root: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench", extra_config={"file_storage_path": root})
    return HiCacheFile(cfg, file_path=root)


class HiCacheFileReader:
    """Writes n pages through HiCacheFile once; read_once() times one cold read of all of them."""

    def __init__(self, root: str, page: int, n: int) -> None:
        logging.getLogger("sglang").setLevel(logging.ERROR)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        self.root, self.page, self.n = root, page, n
        self.backend = build_hicachefile(root)
        self.keys = [f"{i:064x}" for i in range(n)]
        src = torch.randint(0, 255, (page,), dtype=torch.uint8)
        assert self.backend.batch_set(self.keys, [src] * n), "HiCacheFile write failed"
        os.sync()
        self.files = [os.path.join(root, f) for f in os.listdir(root)]
        self.dst = [torch.empty(page, dtype=torch.uint8) for _ in range(min(n, 256))]

    def read_once(self, drop_caches) -> float:
        drop_caches(self.files)
        t = time.perf_counter()
        step = len(self.dst)
        for i in range(0, self.n, step):
            ks = self.keys[i:i + step]
            got = self.backend.batch_get(ks, self.dst[:len(ks)])
            assert all(g is not None for g in got), "HiCacheFile read missed"
        return self.n * self.page / (time.perf_counter() - t)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
