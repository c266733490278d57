"""Model identity (ucm/connectors/identity.py) on small fake model
directories: a config.json next to a fake safetensors file (an 8-byte
header length, a JSON header, the tensor bytes) or a fake GGUF file."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from ucm.connectors import identity
from ucm.connectors.identity import model_fingerprint

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def _safetensors(path: Path, payload: bytes) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(payload)], "data_offsets": [0, len(payload)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def _model_dir(root: Path, name: str, payload: bytes = b"\x01" * 1000, config: dict = CONFIG) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    _safetensors(d / "model.safetensors", payload)
    return d


def test_same_directory_gives_the_same_fingerprint_in_every_call_and_process(tmp_path):
    d = _model_dir(tmp_path, "smol")
    fp = model_fingerprint(d, extra={"dtype": "bfloat16"})
    assert fp == model_fingerprint(d, extra={"dtype": "bfloat16"})
    assert (fp.source, fp.weight_files, len(fp.digest)) == ("files", 1, 32)
    code = ("import sys; from ucm.connectors.identity import model_fingerprint; "
            "print(model_fingerprint(sys.argv[1], extra={'dtype': 'bfloat16'}).digest)")
    env = dict(os.environ, PYTHONHASHSEED="123")  # another hash seed: nothing may depend on hash()
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=env,
                         check=True, cwd=str(tmp_path))
    assert out.stdout.split()[-1] == fp.digest


def test_same_name_with_other_weights_or_config_differs(tmp_path):
    a = _model_dir(tmp_path / "a", "smol", payload=b"\x01" * 1000)
    b = _model_dir(tmp_path / "b", "smol", payload=b"\x02" * 1000)  # a fine-tune: same size, other bytes
    c = _model_dir(tmp_path / "c", "smol", config=dict(CONFIG, rope_theta=5e5))
    for other in (b, c):
        os.utime(other / "model.safetensors", ns=(0, (a / "model.safetensors").stat().st_mtime_ns))
    digests = {model_fingerprint(d).digest for d in (a, b, c)}
    assert len(digests) == 3


def test_a_weight_files_size_or_mtime_changes_it(tmp_path):
    d = _model_dir(tmp_path, "smol")
    w = d / "model.safetensors"
    first = model_fingerprint(d).digest
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    touched = model_fingerprint(d).digest
    assert touched != first
    with open(w, "ab") as f:
        f.write(b"\x00")
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same mtime as `touched`
    assert model_fingerprint(d).digest not in (first, touched)


def test_large_file_is_sampled_and_its_safetensors_header_hashed(tmp_path, monkeypatch):
    """Above the whole-file limit only samples and the header are read: a
    byte changed in a sample or in the header changes the digest, with size
    and mtime kept."""
    monkeypatch.setattr(identity, "WHOLE_FILE_BYTES", 1 << 10)
    monkeypatch.setattr(identity, "SAMPLE_BYTES", 256)
    d = _model_dir(tmp_path, "big", payload=bytes(range(256)) * 64)
    w = d / "model.safetensors"
    mtime = w.stat().st_mtime_ns
    base = model_fingerprint(d).digest
    raw = bytearray(w.read_bytes())
    seen = {base}
    for at in (12, len(raw) // 2, len(raw) - 1):  # in the header, the middle sample, the last sample
        changed = bytearray(raw)
        changed[at] ^= 0xFF
        w.write_bytes(bytes(changed))
        os.utime(w, ns=(mtime, mtime))
        seen.add(model_fingerprint(d).digest)
    assert len(seen) == 4


def test_a_gguf_file_is_its_size_mtime_and_content_not_its_name(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"\x03" * 100)
    b.write_bytes(a.read_bytes())
    mtime = a.stat().st_mtime_ns
    os.utime(b, ns=(mtime, mtime))
    fa = model_fingerprint(a, config=CONFIG)
    assert fa.source == "files" and fa.weight_files == 1
    assert model_fingerprint(b, config=CONFIG) == fa
    b.write_bytes(b"GGUF" + b"\x04" * 100)
    os.utime(b, ns=(mtime, mtime))
    assert model_fingerprint(b, config=CONFIG).digest != fa.digest


def test_shards_index_and_quant_config_count(tmp_path):
    d = _model_dir(tmp_path, "sharded")
    base = model_fingerprint(d)
    _safetensors(d / "model-00002-of-00002.safetensors", b"\x05" * 10)
    two = model_fingerprint(d)
    assert two.weight_files == 2 and two.digest != base.digest
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    with_index = model_fingerprint(d)
    assert with_index.weight_files == 3 and with_index.digest != two.digest
    (d / "quantize_config.json").write_text(json.dumps({"bits": 4}))
    quantized = model_fingerprint(d).digest
    assert quantized != with_index.digest
    (d / "tokenizer.json").write_text("{}")  # not part of the computation
    (d / ".cache").mkdir()
    _safetensors(d / ".cache" / "stale.safetensors", b"\x06")
    assert model_fingerprint(d).digest == quantized


def test_the_directorys_own_path_and_volatile_config_keys_do_not_count(tmp_path):
    a = _model_dir(tmp_path / "one", "smol")
    b = tmp_path / "two" / "renamed"
    b.parent.mkdir()
    os.rename(a, b)  # a move keeps the files (and their mtimes)
    moved = model_fingerprint(b)
    os.rename(b, a)
    assert model_fingerprint(a) == moved
    cfg = dict(CONFIG, _name_or_path=str(a), transformers_version="5.19.0")
    cfg2 = dict(CONFIG, _name_or_path="/elsewhere", transformers_version="5.20.0",
                text_config={"_name_or_path": "x", "hidden_size": 8})
    cfg3 = dict(CONFIG, text_config={"hidden_size": 8})
    assert model_fingerprint(a, config=cfg) == model_fingerprint(a, config=CONFIG)
    assert model_fingerprint(a, config=cfg2) == model_fingerprint(a, config=cfg3)
    assert model_fingerprint(a, config=cfg3) != model_fingerprint(a, config=CONFIG)


def test_revision_and_extra_count(tmp_path):
    d = _model_dir(tmp_path, "smol")
    seen = {model_fingerprint(d).digest, model_fingerprint(d, revision="abc").digest,
            model_fingerprint(d, extra={"dtype": "float16"}).digest,
            model_fingerprint(d, extra={"quantization": "fp8"}).digest}
    assert len(seen) == 4


def test_a_hub_id_not_on_disk_is_its_id_config_and_revision_logged_at_info(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO", logger="ucm.connectors.identity"):
        fp = model_fingerprint("someorg/some-model", revision="main", config=CONFIG)
    assert fp.source == "config" and fp.weight_files == 0
    assert "someorg/some-model" in caplog.text and "revision 'main'" in caplog.text
    assert model_fingerprint("someorg/some-model", revision="main", config=CONFIG) == fp
    assert model_fingerprint("someorg/some-model", revision="v2", config=CONFIG) != fp
    assert model_fingerprint("someorg/some-model", revision="main",
                             config=dict(CONFIG, num_hidden_layers=3)) != fp
    assert model_fingerprint("otherorg/some-model", revision="main", config=CONFIG) != fp  # two fine-tunes


def test_a_hub_snapshot_in_the_cache_is_fingerprinted_by_its_files(tmp_path, monkeypatch):
    snap = _model_dir(tmp_path / "hub", "snapshot")
    monkeypatch.setattr(identity, "_hub_snapshot", lambda model, revision: snap)
    monkeypatch.chdir(tmp_path)
    fp = model_fingerprint("someorg/some-model")
    assert fp.source == "hub-cache" and fp.weight_files == 1
    assert fp.digest == model_fingerprint(snap).digest


def test_canonical_form_is_stable_for_odd_values():
    class Obj:
        pass

    form = identity.canonical({1: {"b", "a"}, "o": Obj(), "t": (1, 2), "n": None})
    assert form == {"1": ["a", "b"], "o": Obj.__qualname__, "t": [1, 2], "n": None}
