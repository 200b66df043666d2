import numpy as np
import pytest
import torch

from radixtier.hashing import KVNamespace, PageHasher, as_token_array


def test_chain_is_stable_across_processes_and_input_types():
    ns = KVNamespace("llama-3-8b", "bfloat16", "page_first", 4)
    h = PageHasher(ns)
    tokens = list(range(10))
    keys = h.chain(tokens)
    assert len(keys) == 2  # 10 tokens = 2 full pages of 4; the partial page is not hashed
    # golden value: any change to the hash scheme breaks cross-node and restart compatibility
    assert keys[0].hex() == h.chain(np.arange(10))[0].hex() == h.chain(torch.arange(10))[0].hex()
    assert keys == PageHasher(KVNamespace("llama-3-8b", "bfloat16", "page_first", 4)).chain(tokens)
    # pinned literal: a change to the hash scheme breaks restart recovery and cross-node sharing
    assert keys[0].hex() == "22ce7cefa2843cdecce3f7f7db3252b7"


def test_key_commits_to_the_whole_prefix_and_namespace():
    h = PageHasher(KVNamespace("m", "bf16", "layer_first", 2))
    a = h.chain([1, 2, 3, 4])
    b = h.chain([9, 2, 3, 4])
    assert a[1] != b[1]  # same second page, different first page
    other = PageHasher(KVNamespace("m", "fp8", "layer_first", 2)).chain([1, 2, 3, 4])
    assert other[0] != a[0]
    # continuing a chain from its parent equals hashing the whole sequence
    assert h.chain([1, 2, 3, 4], parent=a[0], start_page=1) == a[1:]


@pytest.mark.parametrize("bad, msg", [
    ([1, -2], "non-negative"),
    ([1.5, 2], "integer"),
    ([[1, 2]], "1-D"),
    ([True, False], "integer"),
    (np.zeros((2, 2), dtype=np.int64), "1-D"),
    ("abc", "expected list"),
])
def test_bad_tokens_are_named(bad, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        as_token_array(bad)


@pytest.mark.parametrize("field, kwargs", [
    ("model", dict(model="", dtype="bf16", layout="x", page_size=4)),
    ("page_size", dict(model="m", dtype="bf16", layout="x", page_size=0)),
])
def test_bad_namespace_names_field(field, kwargs):
    with pytest.raises(ValueError, match=f"namespace.{field}"):
        KVNamespace(**kwargs)
