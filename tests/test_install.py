"""Installed as users install it: an sdist and a wheel built by the standard build front end
(`python -m build`), each installed into a fresh virtual environment that sees the project's torch
and SGLang but not this checkout. From there: `radixtier --version` names the native parts it runs,
the `sglang.srt.plugins` entry point is registered, and SGLang's own dynamic backend factory loads
`RadixTierStorage` and stores and reads a page through it. A build without a C compiler still
installs and says which fallbacks it uses (never an import error)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from radixtier.testing.skips import require_sglang

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = textwrap.dedent("""
    import importlib.metadata, json, os, sys
    import radixtier
    assert not radixtier.__file__.startswith(sys.argv[1]), radixtier.__file__  # the installed copy, not the checkout
    plugins = [ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "radixtier"]
    from radixtier.testing.sglang_pools import attach, chain_keys, make_host_pool, page_bytes, scramble, slots
    host = make_host_pool("page_first", seed=3)
    b = attach(host, {"path": os.path.join(sys.argv[2], "ns.img"), "capacity": "16MiB", "partitions": 1, "interface_v1": 1})
    keys = chain_keys(2)
    want = [page_bytes(host, p) for p in range(2)]
    put = b.batch_set_v1(keys, slots(0, 2))
    scramble(host, 0, 2)
    got = b.batch_get_v1(keys, slots(0, 2))
    same = [page_bytes(host, p) == w for p, w in enumerate(want)]
    print(json.dumps({"file": radixtier.__file__, "plugins": plugins, "backend": type(b).__module__ + "." +
                      type(b).__name__, "put": put, "get": got, "same": same}))
    b.close()
""")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def _fresh_venv(where: str) -> str:
    """A new virtual environment that also sees this interpreter's site-packages (torch, SGLang), as a
    plain path: the project's own editable install (a .pth finder there) is not loaded."""
    _run([sys.executable, "-m", "venv", "--without-pip", where])
    py = os.path.join(where, "bin", "python")
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    with open(os.path.join(site, "project-site-packages.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _source_copy(dest) -> str:
    """The checkout's sources in a folder of the test's (a build writes build/ and *.egg-info beside them)."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.so", "__pycache__",
                                                              "*.egg-info", "bench", "tests", ".hypothesis"))
    return str(dest)


def _install(py: str, artifact: str, tmp) -> None:
    """pip (this interpreter's, aimed at the new environment) installs the artifact without its
    dependencies: torch and the rest come from the project's environment."""
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-build-isolation", "-q", artifact],
         cwd=str(tmp))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler: the native parts cannot be built here (the no-compiler case is tested below)")
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the standard build front end is missing: pip install build (scripts/setup.sh --test does)")
    out = tmp_path_factory.mktemp("dist")
    # sdist first, then the wheel from that sdist (what `python -m build` does): the sdist must carry
    # every file the build needs, C sources included; no isolation: the build uses this setuptools
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), _source_copy(out / "src")])
    files = sorted(f for f in os.listdir(out) if f != "src")
    return {"dir": str(out), "wheel": next(os.path.join(out, f) for f in files if f.endswith(".whl")),
            "sdist": next(os.path.join(out, f) for f in files if f.endswith(".tar.gz"))}


@pytest.mark.parametrize("artifact", ["wheel", "sdist"])
def test_the_wheel_and_sdist_install_and_sglang_loads_the_backend_from_them(built, artifact, tmp_path):
    require_sglang("sglang.srt.mem_cache.storage.backend_factory")
    py = _fresh_venv(str(tmp_path / "venv"))
    _install(py, built[artifact], tmp_path)
    version = _run([os.path.join(str(tmp_path / "venv"), "bin", "radixtier"), "--version"], cwd=str(tmp_path)).stdout
    assert version.startswith("radixtier ") and "tier-3 I/O: " in version
    if os.path.exists("/usr/include/liburing.h"):
        assert "io_uring, radixtier's native page core" in version, version
    assert "checked in C right before each write" in version and "one native pass" in version, version
    import json

    out = json.loads(_run([py, "-c", CHECK, REPO, str(tmp_path)], cwd=str(tmp_path)).stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(tmp_path / "venv")), out["file"]
    assert out["plugins"] == ["radixtier.integrations.sglang.launch.plugin:register"]
    assert out["backend"] == "radixtier.integrations.sglang.backend.radixtier_storage.RadixTierStorage"
    assert out["put"] == [True, True] and out["get"] == [True, True] and out["same"] == [True, True], out


def test_without_a_c_compiler_it_installs_and_names_its_fallbacks(tmp_path):
    """CC pointing at a compiler that always fails: every extension is optional, so the wheel builds
    without them, installs, imports, and `radixtier --version` says what stands in for each."""
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.fail("the standard build front end is missing: pip install build (scripts/setup.sh --test does)")
    env = {**os.environ, "CC": "false", "LDSHARED": "false"}
    _run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(tmp_path / "dist"),
          _source_copy(tmp_path / "src")], env=env)
    wheel = next(str(tmp_path / "dist" / f) for f in os.listdir(tmp_path / "dist") if f.endswith(".whl"))
    py = _fresh_venv(str(tmp_path / "venv"))
    _install(py, wheel, tmp_path)
    version = _run([os.path.join(str(tmp_path / "venv"), "bin", "radixtier"), "--version"], cwd=str(tmp_path)).stdout
    assert "the preadv/pwritev thread pool (io_uring: radixtier's io_uring extension is not built" in version, version
    assert "_fence extension is not built" in version and "numpy (radixtier._slotpool is not built" in version, version
    imported = _run([py, "-c", "import radixtier.storage.nvmeof.store, radixtier.cache, radixtier.pools; print('ok')"],
                    cwd=str(tmp_path)).stdout
    assert imported.strip() == "ok"
