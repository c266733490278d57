"""ucm.progress: bars on stderr only, never on stdout, and only on a terminal
(or where UCM_PROGRESS forces them), so `--json` output stays pure JSON."""
from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading

import pytest

from ucm import progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("value, expect", [("0", False), ("1", True), ("yes", True)])
def test_the_environment_overrides_the_terminal_check(monkeypatch, value, expect):
    monkeypatch.setenv(progress.ENV, value)
    assert progress.enabled() is expect


def test_off_when_stderr_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert not sys.stderr.isatty()  # pytest captures it
    assert not progress.enabled()
    assert list(progress.bar(range(3), desc="quiet")) == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_a_forced_bar_draws_on_stderr_only(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV, "1")
    with progress.bar(total=2, desc="drawn", unit="step") as b:
        b.set_postfix_str("half")
        b.update(2)
    out, err = capsys.readouterr()
    assert out == "" and "drawn" in err


def test_without_tqdm_a_bar_is_a_silent_iterable(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    monkeypatch.setenv(progress.ENV, "1")
    with progress.bar(["a", "b"], desc="x") as b:
        assert list(b) == ["a", "b"]
        b.update(1)
        b.set_postfix_str("y")
    assert capsys.readouterr() == ("", "")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.mark.parametrize("argv", [
    ["bench", "placement", "--policy", "lru", "--blocks-per-request", "4", "--blocks", "16", "--repeat", "1"],
    ["bench", "io", "--size-mb", "2", "--block-kb", "64", "--batch", "4", "--io-threads", "2",
     "--repeats", "1", "--no-fio"],
], ids=["placement", "io"])
def test_json_stdout_stays_pure_json_while_a_terminal_shows_progress(tmp_path, argv):
    if argv[1] == "io":
        argv = [*argv, "--dir", str(tmp_path)]
    master, slave = pty.openpty()  # stderr is a terminal: the bar is drawn there
    chunks: list[bytes] = []

    def drain() -> None:  # read while the child writes: a closed terminal drops unread bytes
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child's end is closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", *argv, "--json"], stdout=subprocess.PIPE,
                                stderr=slave, env=_env(), cwd=str(tmp_path))
        os.close(slave)
        stdout, _ = proc.communicate(timeout=240)
        reader.join(10)
    finally:
        os.close(master)
    err = b"".join(chunks)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    json.loads(stdout)  # one JSON document, nothing else
    assert b"bench " in err  # the bar's description, on the terminal


def test_json_stdout_has_no_bar_when_forced_on_a_pipe(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ucm.cli", "bench", "placement", "--policy", "lru",
                           "--blocks-per-request", "4", "--blocks", "16", "--repeat", "1", "--json"],
                          capture_output=True, env=_env(UCM_PROGRESS="1"), cwd=str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    json.loads(proc.stdout)
    assert b"bench placement" in proc.stderr
