"""Support shared by the test suite and the benchmarks (never imported by the product).

- `redis_server`: a private redis-server (or a Redis Cluster) on free loopback ports, stopped
  with its process group; tests and `bench/index_lookup.py` start their own, never touching 6379.
- `sglang_driver`: SGLang 0.5.23's cache code (UnifiedRadixCache, HybridCacheController, the real
  allocator) driven the way its scheduler drives it, on CPU, for conformance tests and
  `bench/sglang_path.py` (needs SGLang).
- `naive_store`: the one-file-per-page tier-3 baseline that `bench/ttft.py` measures against.

One package, installed with radixtier, so benchmarks and tests import it by name: no `sys.path`
edits, no test importing another test file.
"""
