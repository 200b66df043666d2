"""The backend's diagnostics name the cause SGLang's setup makes likely (integrations/sglang/backend/diagnosis.py)."""

from __future__ import annotations

from radixtier.integrations.sglang.backend.diagnosis import already_stored_cause


def test_a_backup_of_pages_tier3_holds_is_explained_by_what_the_server_runs():
    # a state-at-prompt-end hybrid (LFM2's convolution state in the mamba pool): expected, whatever the policy
    hybrid = already_stored_cause(["kv", "mamba"], "best_effort", None)
    assert "mamba state only at a prompt's end" in hybrid and "no prefetch setting changes it" in hybrid
    assert "dropped" in already_stored_cause(["kv", "swa"], "best_effort", None)  # an SWA sidecar is not that
    assert already_stored_cause(["kv"], "wait_complete", 512) == (
        "a hit under prefetch_threshold (512 tokens) or a prefetch cut by its timeout")
    unknown = already_stored_cause(["kv"], None, None)
    assert "prefetch_threshold (256 tokens)" in unknown and "best_effort" in unknown

