"""Skipping a test module whose optional dependency is missing -- except under CI, where a broken
install must fail the run instead of passing as "skipped"."""

from __future__ import annotations

import importlib
import os

import pytest


def require_sglang(module: str) -> None:
    """Import `module` (which needs sglang 0.5.23) or skip the calling test module; under CI a broken
    install fails the run instead of passing as "skipped"."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI=true: sglang 0.5.23 does not import ({exc}); "
                               f"bash scripts/setup.sh --test installs it") from exc
        pytest.skip(f"needs sglang 0.5.23 (bash scripts/setup.sh --test): {exc}", allow_module_level=True)


def require_dynamo() -> None:
    """Skip the calling test module unless Dynamo's KV indexer (ai-dynamo-runtime 1.6.1) imports;
    under CI its absence fails the run."""
    try:
        importlib.import_module("dynamo.llm")
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI=true: ai-dynamo-runtime does not import ({exc}); "
                               f"bash scripts/setup.sh --test installs it") from exc
        pytest.skip(f"needs ai-dynamo-runtime 1.6.1 (bash scripts/setup.sh --test): {exc}", allow_module_level=True)
