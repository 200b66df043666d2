"""The suite's own footprint on the machine it runs on: namespaces are fallocated (real blocks, not
sparse), so every test's tmp_path kept until the session ended added up to ~14 GB on disk by the
last test (measured 2026-12-07), and a CI machine with less free space failed a third of the suite
at set-up ("its filesystem has room for 3137536"). A passing test's tmp_path goes at its teardown."""

from __future__ import annotations

_USED: list = []


def test_the_suite_removes_a_passing_tests_tmp_path(pytestconfig, tmp_path):
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
    assert int(pytestconfig.getini("tmp_path_retention_count")) <= 1
    (tmp_path / "namespace.img").write_bytes(b"\0" * 4096)
    _USED.append(tmp_path)


def test_the_previous_tests_tmp_path_is_gone():
    assert _USED, "runs after the test above"
    assert not _USED[0].exists(), f"{_USED[0]} outlived its passing test"
