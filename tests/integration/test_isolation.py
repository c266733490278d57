"""What separates one local user's cache from another's, and what keeps
data from turning into code.

- Another local user can neither connect to the service's socket nor open
  the dram arena or the key index (nor reach them through /proc of the
  service), though it can reach the directory they live in. Needs root to
  create that user (CI runs as root); skipped otherwise.
- The fs adapter's files stay under its directory, whatever bytes a key holds.
- No module of ucm deserialises with pickle or marshal, loads YAML unsafely,
  or evaluates strings as code.
"""
import ast
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from ucm.adapters.base import Status
from ucm.adapters.fs import FsAdapter, FsConfig
from ucm.errors import ArgumentError, ConfigError
from support import start_service, stop_service
from ucm.service import CacheClient

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # the venv's interpreter may sit under /root


def _can_switch_users():
    return (os.geteuid() == 0 and shutil.which("useradd") and shutil.which("userdel")
            and shutil.which("runuser") and SYSTEM_PYTHON)


needs_root = pytest.mark.skipif(not _can_switch_users(),
                                reason="needs root, useradd/userdel, runuser and /usr/bin/python3")

# Runs as the other user: every attempt is "allowed", "denied" or the error.
PROBE = r"""
import json, os, socket, sys
targets = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except PermissionError:
        out[name] = "denied"
    except OSError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
def connect():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(targets["socket"])
    finally:
        s.close()
def opener(path, flags):
    return lambda: os.close(os.open(path, flags))
attempt("control: read a 0644 file beside them", opener(targets["control"], os.O_RDONLY))
attempt("connect to the socket", connect)
for name in ("arena", "index"):
    attempt(f"open the {name} read-write", opener(targets[name], os.O_RDWR))
    attempt(f"open the {name} read-only", opener(targets[name], os.O_RDONLY))
    if targets["destructive"]:
        attempt(f"unlink the {name}", lambda: os.unlink(targets[name]))
if targets["destructive"]:
    attempt("unlink the socket", lambda: os.unlink(targets["socket"]))
pid = targets["pid"]
attempt("list /proc/<service>/fd", lambda: os.listdir(f"/proc/{pid}/fd"))
attempt("list /proc/<service>/map_files", lambda: os.listdir(f"/proc/{pid}/map_files"))
attempt("open /proc/<service>/mem", opener(f"/proc/{pid}/mem", os.O_RDONLY))
for path in targets.get("fs_files", []):
    attempt("read an fs block file", opener(path, os.O_RDONLY))
for path in targets.get("fs_dirs", []):
    attempt("list an fs directory", lambda: os.listdir(path))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def other_user():
    name = f"ucmiso{os.getpid() % 100000}"
    r = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def probe(user, targets):
    """The PROBE's answers, run as `user` (None: this user, and nothing is unlinked)."""
    cmd = [SYSTEM_PYTHON, "-I", "-c", PROBE, json.dumps({**targets, "destructive": user is not None})]
    if user is not None:
        cmd = ["runuser", "-u", user, "--"] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def open_dir():
    """A directory every user may traverse and list (0755, like /dev/shm
    without the sticky bit): only the files' own modes protect them."""
    d = tempfile.mkdtemp(prefix="ucm-isolation-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def service(open_dir):
    sock = str(open_dir / "ucm.sock")
    cfg = {"tiers": [{"adapter": "dram", "capacity": "4MiB", "options": {"path": str(open_dir)}}],
           "policy": {"name": "lru"}, "service": {"socket": sock, "index_slots": 1024}}
    (open_dir / "ucm.yaml").write_text(yaml.safe_dump(cfg))
    proc = start_service(open_dir / "ucm.yaml", sock, timeout_s=60)
    client = CacheClient(sock)
    yield sock, proc, client
    client.close()
    stop_service(proc)


@needs_root
def test_another_user_cannot_reach_the_socket_the_arena_or_the_index(other_user, service, open_dir):
    sock, proc, client = service
    control = open_dir / "readable.txt"
    control.write_text("anyone may read this")
    control.chmod(0o644)
    targets = {"socket": sock, "arena": client.service_info["arena_path"],
               "index": client.service_info["index_path"], "pid": proc.pid, "control": str(control)}
    assert os.path.dirname(targets["arena"]) == str(open_dir) == os.path.dirname(targets["index"])
    mine = probe(None, {**targets, "arena": str(control), "index": str(control)})
    # The probe works: the owner connects and opens what it asks for.
    assert mine["connect to the socket"] == "allowed"
    assert mine["list /proc/<service>/fd"] == "allowed"
    theirs = probe(other_user, targets)
    assert theirs.pop("control: read a 0644 file beside them") == "allowed"  # the directory is reachable
    assert theirs == {k: "denied" for k in theirs}, theirs
    assert len(theirs) == 11
    # Nothing the other user tried took anything away.
    assert client.lookup([os.urandom(16)]) == 0 and client.stats()["service"]["connections"] == 1
    assert os.path.exists(targets["arena"]) and os.path.exists(targets["index"]) and os.path.exists(sock)


@needs_root
def test_another_user_cannot_read_fs_blocks(other_user, open_dir):
    fs = FsAdapter(1 << 20, FsConfig(path=str(open_dir / "fs")))
    try:
        key = os.urandom(16)
        assert fs.put([key], [b"secret" * 100]) == [Status.OK]
        path = fs.path_of(key)
        targets = {"socket": "/nonexistent", "arena": "/nonexistent", "index": "/nonexistent", "pid": os.getpid(),
                   "control": "/etc/hostname", "fs_files": [path], "fs_dirs": [fs.root, os.path.dirname(path)]}
        theirs = probe(other_user, targets)
        assert theirs["read an fs block file"] == "denied"
        assert theirs["list an fs directory"] == "denied"
    finally:
        fs.close()


# ---- fs: keys are bytes, paths stay inside ---------------------------------------------
HOSTILE_KEYS = [k.ljust(16, b".")[:16] for k in (
    b"../" * 5, b"/" * 16, b"\x00" * 16, b"..\x00/" * 4, b"%2e%2e%2f%2e%2e%2f", b"\\..\\..\\..\\..\\",
    bytes(range(16)), bytes(range(240, 256)), "é/../é/../".encode(), b"/etc/passwd\x00", b"~/.ssh/id")]


@pytest.mark.parametrize("shard_levels", [0, 1, 2, 3])
def test_fs_keys_of_any_bytes_stay_inside_its_directory(tmp_path, shard_levels):
    base = tmp_path / "base"
    fs = FsAdapter(1 << 20, FsConfig(path=str(base / "fs"), shard_levels=shard_levels))
    try:
        keys = HOSTILE_KEYS
        assert all(len(k) == 16 for k in keys) and len(set(keys)) == len(keys)
        root = os.path.realpath(fs.root)
        for k in keys:
            p = os.path.realpath(fs.path_of(k))
            assert os.path.commonpath([root, p]) == root and os.path.basename(p) == k.hex() + ".v2"  # the chunked layout's name
        blobs = [k * 8 for k in keys]
        assert fs.put(keys, blobs) == [Status.OK] * len(keys)
        out = [bytearray(len(b)) for b in blobs]
        assert fs.get(keys, out) == [Status.OK] * len(keys)
        assert [bytes(o) for o in out] == blobs
        made = [os.path.join(d, f) for d, _, files in os.walk(base) for f in files]
        assert len(made) == len(keys)
        assert all(os.path.commonpath([root, os.path.realpath(m)]) == root for m in made)
        for bad in ("../../etc/passwd", b"../" * 5, b"x" * 17, b"", None, 16, [b"k" * 16]):
            with pytest.raises(ArgumentError):
                fs.path_of(bad)
            with pytest.raises(ArgumentError):
                fs.put([bad], [b"x"])
    finally:
        fs.close()


@pytest.mark.parametrize("prefix", ["a/b", "../x", "/abs", "", "a\x00b", "x" * 65, "a b", "..", "."])
def test_fs_key_prefix_that_names_another_directory_is_a_config_error(prefix):
    from ucm.config.schema import load_config

    raw = {"tiers": [{"adapter": "dram", "capacity": "4MiB"},
                     {"adapter": "fs", "capacity": "4MiB", "options": {"path": "/tmp/x", "key_prefix": prefix}}]}
    with pytest.raises(ConfigError, match="tiers.1.options.key_prefix"):
        load_config(raw, environ={})


# ---- no pickle anywhere -------------------------------------------------------------------
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "jsonpickle", "shelve", "marshal"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def unsafe_uses(source, filename):
    """(line, what) for each place `source` could run code hidden in data."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            kwargs = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and name in ("eval", "exec", "compile"):
                found.append((node.lineno, f"{name}()"))
            elif name in ("__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant) \
                    and str(node.args[0].value).split(".")[0] in UNSAFE_MODULES:
                found.append((node.lineno, f"{name}({node.args[0].value!r})"))
            elif owner == "yaml" and name in ("unsafe_load", "full_load", "unsafe_load_all", "full_load_all"):
                found.append((node.lineno, f"yaml.{name}"))
            elif owner == "yaml" and name in ("load", "load_all"):
                loader = kwargs.get("Loader", node.args[1] if len(node.args) > 1 else None)
                lname = getattr(loader, "attr", getattr(loader, "id", None))
                if lname not in SAFE_LOADERS:
                    found.append((node.lineno, f"yaml.{name} without a safe Loader"))
            elif owner in ("torch",) and name == "load":
                wo = kwargs.get("weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append((node.lineno, "torch.load without weights_only=True"))
            elif name == "load" and isinstance(kwargs.get("allow_pickle"), ast.Constant) \
                    and kwargs["allow_pickle"].value is True:
                found.append((node.lineno, "load(allow_pickle=True)"))
            elif owner == "msgpack" and name in ("unpackb", "Unpacker") and \
                    ("ext_hook" in kwargs or "object_hook" in kwargs or "object_pairs_hook" in kwargs):
                found.append((node.lineno, f"msgpack.{name} with a hook"))
    return found


def test_no_module_turns_data_into_code():
    files = sorted((ROOT / "ucm").rglob("*.py"))
    assert len(files) > 20
    found = {str(p.relative_to(ROOT)): unsafe_uses(p.read_text(), str(p)) for p in files}
    assert {f: u for f, u in found.items() if u} == {}


def test_the_scan_finds_what_it_looks_for():
    bad = '''
import pickle
from marshal import loads
import yaml, torch, numpy
yaml.load(text)
yaml.load(text, Loader=yaml.Loader)
yaml.full_load(text)
eval("1")
exec("x = 1")
torch.load(path)
numpy.load(path, allow_pickle=True)
__import__("pickle")
'''
    good = '''
import yaml, torch, msgpack
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
torch.load(path, weights_only=True)
model.eval()
msgpack.unpackb(b, raw=False)
"pickle eval( exec("
'''
    assert [line for line, _ in unsafe_uses(bad, "bad.py")] == [2, 3, 5, 6, 7, 8, 9, 10, 11, 12]
    assert unsafe_uses(good, "good.py") == []
