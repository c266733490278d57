import dataclasses
import re
import struct

import numpy as np
import pytest

from ucm import _native
from ucm.errors import ArgumentError
from ucm.keys import DIGEST_FIELDS, DIGEST_VERSION, Namespace, block_keys


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


# ---- the key format, pinned ---------------------------------------------------
# Keys are stable across processes, releases and machines; that is what lets
# NVMe and cluster blocks be found again. The values below were computed once
# and are written out: a change to any of them is a format change, which must
# come with a new DIGEST_VERSION (or LAYOUT_VERSION) and a note that old media
# miss. cpp/tests/test_core.cpp checks the same vectors against xxHash directly.

NS_A = dict(model="smollm2-135m", kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_size=64,
            block_tokens=256)
NS_B = dict(model="sha256:0f1e2d3c", kv_dtype="float16", num_layers=2, num_kv_heads=8, head_size=128,
            block_tokens=16, tp_rank=1, tp_size=2, layout="vllm-cuda-page16-NHD", salt="tenant-\u00e4")


def _canonical(**f) -> bytes:
    """The digest encoding written out from the format in ucm/keys.py's docstring."""
    out = b"ucm.namespace" + bytes([2, 11])
    for name, kind in [("model", "s"), ("kv_dtype", "s"), ("num_layers", "i"), ("num_kv_heads", "i"),
                       ("head_size", "i"), ("block_tokens", "i"), ("tp_rank", "i"), ("tp_size", "i"),
                       ("layout", "s"), ("layout_version", "i"), ("salt", "s")]:
        v = f[name]
        out += bytes([len(name)]) + name.encode() + kind.encode()
        out += struct.pack("<I", len(v.encode())) + v.encode() if kind == "s" else struct.pack("<q", v)
    return out


def test_digest_encoding_covers_every_field_in_a_fixed_order():
    # A field added to Namespace must be added to DIGEST_FIELDS (and DIGEST_VERSION bumped).
    assert [name for name, _ in DIGEST_FIELDS] == [f.name for f in dataclasses.fields(Namespace)]
    assert DIGEST_VERSION == 2
    for kw in (NS_A, NS_B):
        n = Namespace(**kw)
        assert n.canonical_bytes() == _canonical(**dataclasses.asdict(n))
        assert n.digest() == _native.digest128(n.canonical_bytes())


def test_namespace_digests_are_fixed_vectors():
    assert Namespace(**NS_A).digest().hex() == "0ef30df10995485f95064255df088329"
    assert Namespace(**NS_B).digest().hex() == "0fe23e9ced64082eef5e90f5e63575ef"


def test_digest128_matches_published_xxh3_128_vectors():
    assert _native.digest128(b"").hex() == "99aa06d3014798d86001c324468d497f"
    assert _native.digest128(b"abc").hex() == "06b05ab6733a618578af5f94892f3950"


CHAIN_TOKENS = [0, 1, 0xFFFFFFFF, 42, 7, 7, 7, 7, 100000, 5]  # two blocks of 4 and a partial one


@pytest.mark.parametrize("seed,tokens,block_tokens,expect", [
    pytest.param(NS_A, list(range(512)), None,
                 ["bbf1185d8550a9e9a13ebefa2a3d543c", "20c680326eb9171d2fb25fc481000279"], id="namespace"),
    pytest.param(NS_A, [i * 7919 % 49152 for i in range(600)], None,  # 88 tokens of a partial block, not keyed
                 ["4abeb2ee18bb4b5b879c77061f4f4a1f", "1a4a64acf2169adf17e54f8220de65ab"], id="partial-block"),
    pytest.param(bytes(range(16)), CHAIN_TOKENS, 4,  # continuing from a 16-byte key
                 ["28f3cae8d82cef12f51f2eff5579f990", "27c93a501a256314d502a3393f855836"], id="digest-seeded"),
])
def test_block_keys_are_fixed_vectors(seed, tokens, block_tokens, expect):
    seed = Namespace(**seed) if isinstance(seed, dict) else seed
    assert [k.hex() for k in block_keys(seed, tokens, block_tokens)] == expect


def test_bad_digest_fields_are_typed_errors():
    with pytest.raises(ArgumentError, match="Namespace.layout must be a str, got 3"):
        Namespace(**NS_A, layout=3)
    with pytest.raises(ArgumentError, match=re.escape("Namespace.layout_version must be an int in [-2**63, 2**63), got '1'")):
        Namespace(**NS_A, layout_version="1")
