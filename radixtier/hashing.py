"""Chained page hashes: the stable identity of a KV page across processes and machines.

A page's key is blake2b(parent_key || page tokens as little-endian int64), seeded by a
namespace digest (model, dtype, layout, page size, tenant), so the same tokens under a
different model or layout never share a key, and the key of page i commits to every token
before it: a key hit is a prefix hit.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import numpy as np

from radixtier.storage.api import KEY_BYTES  # the storage contract's key length

DIGEST_BYTES = KEY_BYTES
_HASH_VERSION = b"radixtier/page-hash/v1"


def page_key(data: bytes) -> bytes:
    """The one page-key function: a 16-byte blake2b digest. Token pages chain it over
    (parent key || tokens) (PageHasher.chain); the SGLang plugin applies it to SGLang's own page
    hash plus what makes the bytes differ per rank and layout (radixtier/integrations/sglang/backend/keys.py)."""
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def _validated_token_array(arr: np.ndarray, source: str, check_values: bool = True) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {tuple(arr.shape)} ({source})")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected integer token ids, got dtype {arr.dtype} ({source})")
    out = np.ascontiguousarray(arr, dtype="<i8")
    if check_values and out.size and int(out.min()) < 0:
        raise ValueError(f"tokens: token ids must be non-negative, got {int(out.min())}")
    return out


def as_token_array(tokens: Any, check_values: bool = True) -> np.ndarray:
    """Normalise list / tuple / array('q') / numpy / torch token ids to a contiguous little-endian
    int64 array. array('q') (what SGLang 0.5.23 holds a request's tokens in) and int64 numpy or
    CPU torch input are viewed without a copy: callers that keep tokens copy them.

    check_values=False skips the pass over every id that rejects negative ones: for read-only
    lookups, where an id no insert could have stored simply matches nothing."""
    if isinstance(tokens, array) and tokens.itemsize == 8 and tokens.typecode in "ql":
        return _validated_token_array(np.frombuffer(tokens, dtype=np.int64), "array", check_values)
    if isinstance(tokens, np.ndarray):
        return _validated_token_array(tokens, "numpy", check_values)
    try:
        import torch

        if isinstance(tokens, torch.Tensor):
            return _validated_token_array(tokens.detach().to("cpu").numpy(), "torch", check_values)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    if isinstance(tokens, (list, tuple, range)):
        if len(tokens) == 0:
            return np.zeros(0, dtype="<i8")
        if type(tokens[0]) is not bool:
            try:  # array('q') converts a list of ints 1.5x faster than numpy; anything odd takes the path below
                return _validated_token_array(np.frombuffer(array("q", tokens), dtype=np.int64), "list", check_values)
            except (TypeError, OverflowError):
                pass
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError, OverflowError):
            raise ValueError("tokens: expected a flat sequence of integer token ids") from None
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
            if arr.ndim == 1 and arr.dtype.kind != "b":
                bad = next((t for t in tokens if not isinstance(t, (int, np.integer))), arr[0])
                raise ValueError(f"tokens: expected integer token ids, got {type(bad).__name__} {bad!r}")
            raise ValueError(f"tokens: expected integer token ids, got a {arr.dtype} array of shape {arr.shape}")
        return _validated_token_array(arr, "list", check_values)
    if isinstance(tokens, array):
        return _validated_token_array(np.asarray(tokens), "array", check_values)
    raise TypeError(f"tokens: expected list, tuple, array, numpy array or torch tensor, got {type(tokens).__name__}")


@dataclass(frozen=True)
class KVNamespace:
    """What makes two pages with equal tokens interchangeable: same model, dtype, layout, page size, tenant."""

    model: str
    dtype: str
    layout: str
    page_size: int
    tenant: str = ""

    def __post_init__(self) -> None:
        for field in ("model", "dtype", "layout"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"namespace.{field}: expected a non-empty string, got {value!r}")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size <= 0:
            raise ValueError(f"namespace.page_size: expected a positive integer, got {self.page_size!r}")

    def digest(self) -> bytes:
        text = "\x1f".join([self.model, self.dtype, self.layout, str(self.page_size), self.tenant])
        return page_key(_HASH_VERSION + b"\x00" + text.encode())

    def tag(self) -> str:
        """Short printable id, used to prefix index keys."""
        return self.digest().hex()[:16]


class PageHasher:
    """Computes chained page keys for token sequences under one namespace."""

    def __init__(self, namespace: KVNamespace) -> None:
        self.namespace = namespace
        self.page_size = namespace.page_size
        self.root = namespace.digest()

    def num_full_pages(self, num_tokens: int) -> int:
        return num_tokens // self.page_size

    def chain(self, tokens: Any, parent: Optional[bytes] = None, start_page: int = 0,
              num_pages: Optional[int] = None) -> List[bytes]:
        """Keys of full pages [start_page, start_page+num_pages); parent is the key of page start_page-1."""
        arr = tokens if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<i8") else as_token_array(tokens)
        total = arr.size // self.page_size
        end = total if num_pages is None else min(total, start_page + num_pages)
        prev = self.root if parent is None else parent
        if start_page > 0 and parent is None:
            raise ValueError("chain: parent key is required when start_page > 0")
        out: List[bytes] = []
        ps = self.page_size
        buf = arr[start_page * ps:end * ps].tobytes()
        step = ps * 8
        blake = hashlib.blake2b
        for i in range(end - start_page):
            prev = blake(prev + buf[i * step:(i + 1) * step], digest_size=KEY_BYTES).digest()  # page_key, inlined
            out.append(prev)
        return out


def hex_keys(keys: Iterable[bytes]) -> List[str]:
    return [k.hex() for k in keys]
