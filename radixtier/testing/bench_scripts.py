"""Benchmark scripts loaded as modules by the tests that check them (bench/ is not a package and
is not put on sys.path): loaded from the source tree by path, under a private module name."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as module `radixtier_bench_<name>` (registered, as dataclasses need)."""
    path = os.path.join(BENCH_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"name: no benchmark script {path} (run the tests from a source checkout)")
    mod_name = f"radixtier_bench_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module
