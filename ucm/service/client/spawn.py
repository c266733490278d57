"""Getting a client of the node's service: `connect`, which starts a
private `ucm serve` for the config when none answers.

Runs in the engine process (any thread). Racing starters of one config are
serialised by an flock on `<socket>.lock`, so one service starts; the
private service exits once no client has used it for `idle_exit_s`. Its
output goes to `<runtime dir>/<name>.log`.
"""
from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping, Union

import yaml

from ucm.config.schema import UcmConfig, load_config
from ucm.service.client.cache_client import CacheClient
from ucm.service.paths import runtime_dir, socket_path

log = logging.getLogger(__name__)


def connect(config: Union[None, str, Mapping[str, Any], UcmConfig] = None, start: bool = True,
            timeout_s: float = 60.0, idle_exit_s: float = 5.0) -> CacheClient:
    """A client of the service for `config`. When none is running and
    `start` is true, starts a private one for this config (it exits once no
    client has used it for `idle_exit_s`)."""
    cfg = config if isinstance(config, UcmConfig) else load_config(config)
    path = socket_path(cfg)
    client = CacheClient(path, cfg)
    if client.connected or not start:
        return client
    lock_path = path + ".lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter among racing processes
        if client.try_connect():  # another process started one meanwhile
            return client
        fd, cfg_path = tempfile.mkstemp(prefix="ucm-private-", suffix=".yaml", dir=runtime_dir())
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f)
        log_path = os.path.join(runtime_dir(), f"{cfg.service.name}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ucm.cli", "serve", "--config", cfg_path, "--private",
                 "--idle-exit-s", str(idle_exit_s)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                cwd=runtime_dir(),  # not the caller's directory: a source tree there may shadow ucm
                env={**os.environ, "UCM_CONFIG": ""})
        client.spawned = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if client.try_connect():
                break
            time.sleep(0.05)
        try:
            os.unlink(cfg_path)
        except OSError:
            pass
    if not client.connected:
        proc = client.spawned
        why = (f": it did not answer within {timeout_s:g} s" if proc is not None and proc.poll() is None
               else _last_error(log_path))
        log.warning("ucm: could not start a private service for %s%s (log: %s); running without a cache",
                    path, why, log_path)
    return client


def _last_error(log_path: str) -> str:
    """': <the service's last log line>' (why it did not start), or ''."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f": {lines[-1]}" if lines else ""
