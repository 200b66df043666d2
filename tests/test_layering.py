"""The layering the README describes, pinned: each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixtier.testing.imports import cycles, import_graph, modules


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
                                                 "radixtier.mover", "radixtier.pools"))}


def test_format_and_inspect_do_not_import_torch_or_the_demo(tmp_path):
    path = tmp_path / "ns.img"
    code = (f"from radixtier.cli import main\n"
            f"assert main(['format', {str(path)!r}, '--page-bytes', '16KiB', '--capacity', '8MiB']) == 0\n"
            f"assert main(['inspect', {str(path)!r}]) == 0\n")
    mods = loaded_after(code)
    assert "torch" not in mods
    assert not {m for m in mods if m.startswith("radixtier.demo")}


def test_the_core_never_imports_the_demo():
    mods = loaded_after("import radixtier, radixtier.cache, radixtier.cli, radixtier.tree, radixtier.mover")
    assert not {m for m in mods if m.startswith("radixtier.demo")}


@pytest.mark.sglang
def test_the_sglang_backend_does_not_load_the_embedded_cache_or_tree():
    try:
        import sglang  # noqa: F401
    except ImportError as exc:  # pragma: no cover - CI installs it
        pytest.skip(f"sglang is not installed: {exc}")
    mods = loaded_after("import radixtier.integrations.sglang.backend.radixtier_storage")
    assert not {m for m in mods if m.startswith(("radixtier.cache", "radixtier.tree", "radixtier.mover",
                                                 "radixtier.pools", "radixtier.demo"))}
    assert "radixtier.storage.publisher" in mods  # the same storage layer the embedded cache uses
    # the tools that run SGLang here (the CPU support layer, the server launcher) are not the backend's
    assert not {"radixtier.integrations.sglang.launch.cpu_support", "radixtier.integrations.sglang.launch.server"} & mods


def test_the_plugin_entry_point_loads_nothing_heavy():
    """SGLang loads plugins in every process before anything else: the entry point must stay light."""
    mods = loaded_after("import radixtier.integrations.sglang.launch.plugin")
    assert not {"torch", "sglang", "radixtier.integrations.sglang.backend.radixtier_storage"} & mods


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
    """The eviction order and the page checksum live in neutral modules (radixtier/eviction.py,
    radixtier/storage/checksum.py) that the tree, the store and the RDMA transport import downward."""
    mods = loaded_after("import radixtier.tree, radixtier.cache, radixtier.storage.rdma")
    assert not {m for m in mods if m.startswith("radixtier.storage.nvmeof")}
    assert {"radixtier.eviction", "radixtier.storage.checksum"} <= mods


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


# ---------------------------------------------------------------------------- the house's shape
# modules allowed past MAX_MODULE_LINES, each with the reason it stays whole
MAX_MODULE_LINES = 600
LONG_MODULES: dict = {}


def test_the_loop_finder_finds_a_loop():
    """The check below can fail: a two-module loop, and one through TYPE_CHECKING, are found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_loops_anywhere():
    """No module of radixtier, radixtier.storage or radixtier.integrations reaches itself through
    imports, counting function-level and TYPE_CHECKING imports."""
    loops = cycles(import_graph(modules()))
    assert not loops, f"import loops: {loops}"


def test_no_module_is_long_without_a_stated_reason():
    mods = modules()
    long = {name: len(path.read_text().splitlines()) for name, path in mods.items()
            if len(path.read_text().splitlines()) > MAX_MODULE_LINES and name not in LONG_MODULES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them, or state why in LONG_MODULES): {long}"


def test_the_store_config_is_embedded_not_copied():
    """The SGLang backend's config holds the page store's StoreConfig, and re-declares none of its
    fields; extra_config keys of the same names fill it."""
    import dataclasses

    from radixtier.storage.nvmeof.config import StoreConfig

    try:
        from radixtier.integrations.sglang.backend.config import BackendConfig
    except ImportError as exc:  # pragma: no cover - needs the redis package only
        pytest.skip(str(exc))
    own = {f.name for f in dataclasses.fields(BackendConfig)}
    store_fields = {f.name for f in dataclasses.fields(StoreConfig)}
    assert not own & store_fields, own & store_fields
    assert isinstance(BackendConfig().store, StoreConfig)
    cfg = BackendConfig.from_extra_config({"path": "/tmp/x.img", "queue_depth": 8, "io_engine": "threads"})
    assert (cfg.store.queue_depth, cfg.store.io_engine) == (8, "threads")
    assert store_fields <= BackendConfig.keys()


def test_opening_a_namespace_reads_its_superblock_once(tmp_path, monkeypatch):
    """The page store and the SGLang attach step used to read the superblock, plan the layout and
    test "fresh file" each on their own: now the namespace is opened once and handed over."""
    from radixtier.storage.nvmeof import layout
    from radixtier.storage.nvmeof.store import NvmeofPageStore

    calls = {"unpack": 0, "plan": 0}
    real_unpack, real_plan = layout.Superblock.unpack, layout.Superblock.plan

    def unpack(block, where):
        calls["unpack"] += 1
        return real_unpack(block, where)

    def plan(*args, **kwargs):
        calls["plan"] += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(layout.Superblock, "unpack", staticmethod(unpack))
    monkeypatch.setattr(layout.Superblock, "plan", staticmethod(plan))
    path = str(tmp_path / "ns.img")
    NvmeofPageStore(path, 4096, create_bytes=4 << 20).close()
    assert calls == {"unpack": 0, "plan": 1}  # created: planned once, nothing read back
    calls.update(unpack=0, plan=0)
    NvmeofPageStore(path).close()
    assert calls == {"unpack": 1, "plan": 0}
    try:
        from radixtier.integrations.sglang.backend.attach import open_partition
        from radixtier.integrations.sglang.backend.config import BackendConfig
    except ImportError as exc:  # pragma: no cover
        pytest.skip(str(exc))
    calls.update(unpack=0, plan=0)
    cfg = BackendConfig.from_extra_config({"path": path})
    open_partition(cfg, 4096, 0, "n").close()
    assert calls == {"unpack": 1, "plan": 0}
    calls.update(unpack=0, plan=0)
    fresh = BackendConfig.from_extra_config({"path": str(tmp_path / "new.img"), "capacity": "8MiB", "partitions": 2})
    open_partition(fresh, 4096, 1, "n").close()
    assert calls == {"unpack": 0, "plan": 1}


def test_the_index_operator_tools_are_loaded_by_the_cli_only():
    """fleet status, bad-entry counts and collect-all-garbage live in redis_admin, which the
    serving path (the index itself, the embedded cache, the SGLang backend) never loads."""
    import ast
    import pathlib

    mods = loaded_after("import radixtier.storage.index.redis_index, radixtier.cache, "
                        "radixtier.integrations.sglang.backend.attach, radixtier.integrations.sglang.backend.config")
    assert "radixtier.storage.index.redis_index" in mods
    assert "radixtier.storage.index.redis_admin" not in mods
    importers = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(pathlib.Path(path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "radixtier.storage.index.redis_admin":
                importers.append(name)
    assert importers == ["radixtier.cli"], importers


# ---------------------------------------------------------------------------- issue 37's rules
def _imports_of(prefixes) -> dict:
    """{module: radixtier modules it imports} for the modules whose names start with `prefixes`."""
    graph = import_graph(modules())
    return {m: {t for t in ts if t.startswith("radixtier")} for m, ts in graph.items() if m.startswith(prefixes)}


def test_the_storage_layer_imports_no_serving_path_or_fleet_service():
    for mod, targets in _imports_of(("radixtier.storage",)).items():
        bad = {t for t in targets if t.startswith(("radixtier.integrations", "radixtier.fleet", "radixtier.cache",
                                                   "radixtier.tree", "radixtier.mover", "radixtier.demo"))}
        assert not bad, f"{mod} imports {sorted(bad)}"


def test_the_fleet_service_is_reached_only_from_the_cli():
    importers = sorted(m for m, ts in _imports_of(("radixtier",)).items()
                       if not m.startswith("radixtier.fleet") and any(t.startswith("radixtier.fleet") for t in ts))
    assert importers == ["radixtier.cli"], importers


def test_the_sglang_backend_reads_and_writes_through_the_tier_client():
    """SGLang's surface holds SGLang's calls; the local-then-remote read, the hint cache and what
    follows a write are the storage layer's TierClient (the embedded path shares the Publisher)."""
    backend = _imports_of(("radixtier.integrations.sglang.backend.radixtier_storage",))[
        "radixtier.integrations.sglang.backend.radixtier_storage"]
    assert "radixtier.storage.client" in backend
    assert not {"radixtier.storage.publisher", "radixtier.storage.nvmeof.store"} & backend
    # the SGLang folder by job: the backend never loads how SGLang is launched
    for mod, targets in _imports_of(("radixtier.integrations.sglang.backend",
                                     "radixtier.integrations.sglang.events")).items():
        assert not {t for t in targets if t.startswith("radixtier.integrations.sglang.launch")}, mod


def test_the_slot_table_keeps_its_lock_and_tuples_to_itself():
    """Only the store uses the slot table, through its whole-batch calls: nobody imports its tuple
    positions, and no other module touches its lock, index or order."""
    import ast
    import re

    mods = modules()
    importers = {m for m, ts in _imports_of(("radixtier",)).items() if "radixtier.storage.nvmeof.slots" in ts}
    assert importers == {"radixtier.storage.nvmeof.store"}, importers
    src = ast.parse(mods["radixtier.storage.nvmeof.store"].read_text())
    names = {a.name for n in ast.walk(src) if isinstance(n, ast.ImportFrom)
             and n.module == "radixtier.storage.nvmeof.slots" for a in n.names}
    assert names <= {"SlotTable", "PutPlan", "ReadPlan"}, names
    for name, path in mods.items():
        if name != "radixtier.storage.nvmeof.slots":
            hit = re.search(r"slots\.(_lock|_index|_order|lock|index|order)\b", path.read_text())
            assert hit is None, f"{name}: {hit.group(0)}"


def test_names_say_once_what_they_are():
    """One Publisher (the index's queue is PublishQueue); no look-alike module pairs; KEY_BYTES
    defined once, in the storage contract."""
    import ast
    import re

    mods = modules()
    publishers = [m for m, p in mods.items()
                  if any(isinstance(n, ast.ClassDef) and n.name == "Publisher" for n in ast.walk(ast.parse(p.read_text())))]
    assert publishers == ["radixtier.storage.publisher"], publishers
    assert not {"radixtier.transfer", "radixtier.plan", "radixtier.cache.policy", "radixtier.storage.eviction",
                "radixtier.storage.validate", "radixtier.storage.fleet_view"} & set(mods)
    defined = [m for m, p in mods.items() if re.search(r"^KEY_BYTES\s*=", p.read_text(), re.M)]
    assert defined == ["radixtier.storage.api"], defined
