"""Why SGLang backed up pages tier 3 already holds -- the cause named, not guessed.

SGLang backs up only what its tree does not know to be in storage, so such a backup means the
scheduler computed KV it could have loaded. Three causes look alike from the backend:
- **a hybrid whose state SGLang keeps only at a prompt's end** (a Mamba / linear-attention sidecar
  pool, e.g. LFM2's convolution state): a lookup can match at most up to the token before the
  state, so a prompt identical to an earlier one gets no storage hit and is backed up again --
  expected, and no prefetch setting changes it;
- **a prefetch dropped before its read landed**: `--hicache-storage-prefetch-policy best_effort`
  lets the scheduler move on without it;
- **a hit under `prefetch_threshold`** (extra_config; SGLang's default 256 tokens), or a prefetch cut
  by its timeout.
"""

from __future__ import annotations

from typing import Iterable, Optional

STATE_AT_PROMPT_END_POOLS = frozenset({"mamba"})  # SGLang's PoolName.MAMBA: state kept at a prompt's end
DEFAULT_PREFETCH_THRESHOLD = 256  # SGLang's, in tokens (HybridCacheController)


def prefetch_policy() -> Optional[str]:
    """SGLang's --hicache-storage-prefetch-policy in this process, or None where it cannot be read."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().hicache_storage_prefetch_policy)
    except Exception:  # outside a server process (tests, tools): unknown
        return None


def already_stored_cause(pools: Iterable[str], policy: Optional[str], threshold: Optional[int]) -> str:
    """The most likely cause, as a clause for the warning (see the module docstring). `pools`: the
    registered host pools' names; `policy`: SGLang's prefetch policy (None: unknown); `threshold`:
    extra_config's prefetch_threshold (None: SGLang's default)."""
    state = sorted(set(pools) & STATE_AT_PROMPT_END_POOLS)
    if state:
        return (f"this hybrid keeps its {'/'.join(state)} state only at a prompt's end, so a prompt identical to an "
                f"earlier one cannot hit past its last page and is recomputed and backed up again (expected; no "
                f"prefetch setting changes it)")
    if policy == "best_effort":
        return ("a prefetch was dropped before its read landed (--hicache-storage-prefetch-policy best_effort; "
                "wait_complete or timeout keep it)")
    shown = DEFAULT_PREFETCH_THRESHOLD if threshold is None else threshold
    return (f"a hit under prefetch_threshold ({shown} tokens) or a prefetch cut by its timeout"
            + ("" if policy is not None else " (or, with --hicache-storage-prefetch-policy best_effort, a prefetch "
                                              "dropped before its read landed)"))
