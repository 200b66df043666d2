"""The layering the README describes, pinned: each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest


def loaded_after(code: str) -> set:
    """Module names loaded by a fresh interpreter after running `code`."""
    probe = code + "\nimport sys\nprint('--modules--')\nprint('\\n'.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split("--modules--", 1)[1].split())


def test_the_storage_layer_does_not_import_the_embedded_cache_or_demo():
    mods = loaded_after("import radixtier.storage.nvmeof.store, radixtier.storage.index.redis_index, "
                        "radixtier.storage.publisher, radixtier.storage.nvmeof.inspect")
    assert not {m for m in mods if m.startswith(("radixtier.cache", "radixtier.tree", "radixtier.demo",
                                                 "radixtier.transfer", "radixtier.pools"))}


def test_format_and_inspect_do_not_import_torch_or_the_demo(tmp_path):
    path = tmp_path / "ns.img"
    code = (f"from radixtier.cli import main\n"
            f"assert main(['format', {str(path)!r}, '--page-bytes', '16KiB', '--capacity', '8MiB']) == 0\n"
            f"assert main(['inspect', {str(path)!r}]) == 0\n")
    mods = loaded_after(code)
    assert "torch" not in mods
    assert not {m for m in mods if m.startswith("radixtier.demo")}


def test_the_core_never_imports_the_demo():
    mods = loaded_after("import radixtier, radixtier.cache, radixtier.cli, radixtier.tree, radixtier.transfer")
    assert not {m for m in mods if m.startswith("radixtier.demo")}


@pytest.mark.sglang
def test_the_sglang_backend_does_not_load_the_embedded_cache_or_tree():
    try:
        import sglang  # noqa: F401
    except ImportError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"sglang is not installed: {exc}")
    mods = loaded_after("import radixtier.integrations.sglang.backend")
    assert not {m for m in mods if m.startswith(("radixtier.cache", "radixtier.tree", "radixtier.transfer",
                                                 "radixtier.pools", "radixtier.demo"))}
    assert "radixtier.storage.publisher" in mods  # the same storage layer the embedded cache uses
    # the tools that run SGLang here (the CPU support layer, the server launcher) are not the backend's
    assert not {"radixtier.integrations.sglang.cpu_support", "radixtier.integrations.sglang.server"} & mods


def test_the_plugin_entry_point_loads_nothing_heavy():
    """SGLang loads plugins in every process before anything else: the entry point must stay light."""
    mods = loaded_after("import radixtier.integrations.sglang.plugin")
    assert not {"torch", "sglang", "radixtier.integrations.sglang.backend"} & mods


def test_both_paths_publish_through_one_publisher():
    mods = loaded_after("import radixtier.cache")
    assert "radixtier.storage.publisher" in mods


def test_record_tier_names_are_the_tier_labels():
    from radixtier.storage.api import HOST_TIER, STORAGE_TIER
    from radixtier.tiers import Tier

    assert (Tier.STORAGE.label, Tier.HOST.label) == (STORAGE_TIER, HOST_TIER)


def test_implementations_satisfy_the_storage_protocols(tmp_path):
    """The protocols are complete, so callers never probe: every implementation has every method."""
    from radixtier.storage.api import PageStore, PrefixIndex
    from radixtier.storage.index.inprocess import InProcessIndex
    from radixtier.storage.index.redis_index import RedisPrefixIndex
    from radixtier.storage.nvmeof.store import NvmeofPageStore

    from radixtier.testing.naive_store import OneFilePerPageStore

    store = NvmeofPageStore(str(tmp_path / "ns.img"), 4096, create_bytes=4 << 20)
    naive = OneFilePerPageStore(str(tmp_path / "naive"), 4096, 8)
    try:
        assert isinstance(store, PageStore) and isinstance(naive, PageStore)
        assert isinstance(InProcessIndex("n"), PrefixIndex)
        for name in ("publish", "unpublish", "lookup", "set_republisher", "flush", "health", "close"):
            assert callable(getattr(RedisPrefixIndex, name)), name
    finally:
        store.close()


def test_the_tree_the_cache_and_rdma_import_nothing_from_the_nvmeof_backend():
    """The eviction order and the page checksum live in neutral modules (storage/eviction.py,
    storage/checksum.py) that the tree, the store and the RDMA transport import downward."""
    mods = loaded_after("import radixtier.tree, radixtier.cache, radixtier.storage.rdma")
    assert not {m for m in mods if m.startswith("radixtier.storage.nvmeof")}
    assert {"radixtier.storage.eviction", "radixtier.storage.checksum"} <= mods


def test_tests_and_benchmarks_share_support_by_package_not_by_path():
    """Shared helpers live in radixtier.testing: no test or benchmark edits sys.path or imports a
    test file, and the product never imports radixtier.testing."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    for path in sorted([*root.glob("tests/*.py"), *root.glob("bench/*.py")]):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append") and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "path" and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id == "sys":
                raise AssertionError(f"{path.name}:{node.lineno} edits sys.path")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("test_", "conftest")):
                raise AssertionError(f"{path.name}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith(("test_", "conftest")) for a in node.names):
                raise AssertionError(f"{path.name}:{node.lineno} imports a test file")
    mods = loaded_after("import radixtier, radixtier.cache, radixtier.cli, radixtier.storage.nvmeof.store, "
                        "radixtier.storage.index.redis_index, radixtier.demo.server_demo")
    assert not {m for m in mods if m.startswith("radixtier.testing")}


def test_the_prefix_handle_does_not_import_the_planner_back():
    """The planner makes handles; a handle reaches it through the PrefixLoader protocol only."""
    import ast
    import pathlib

    src = pathlib.Path(__file__).resolve().parent.parent / "radixtier" / "cache" / "handle.py"
    imported = {n.module for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.ImportFrom)}
    assert "radixtier.cache.planner" not in imported
