"""Helpers shared by the test suites (importable as `support`: tests/ is on
sys.path through tests/conftest.py)."""
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time

SIZE = 64 * 1024


def chain(n, seed, size=SIZE):
    """Consecutive block keys of one prompt and their payloads (each derived
    from its key, so any copy can be checked)."""
    keys, data, prev = [], [], seed.to_bytes(16, "little")
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
        data.append(hashlib.shake_128(prev).digest(size))
    return keys, data


def start_service(cfg_path, sock, timeout_s=30.0, log=None):
    """`ucm serve --config cfg_path` as a subprocess, once its socket answers;
    its output goes to the open file `log`, else to a pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "ucm.cli", "serve", "--config", str(cfg_path)],
                            stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if log is None else open(log.name).read()
            raise AssertionError(f"service exited: {out}")
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            s.close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("service did not start")


def freeze(proc, timeout_s=10.0):
    """SIGSTOP `proc` and return once every one of its threads is stopped:
    `kill` only queues the signal, and a thread running on the other core
    goes on for a while (what it writes to shared memory meanwhile counts)."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that exited meanwhile
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {proc.pid} did not stop within {timeout_s} s")


def stop_service(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()
