"""Where the service's files live, and the cleanup of files killed services left.

Used by both sides: the client finds the socket here, the service binds it
and removes what an earlier, killed instance left behind (shared-memory
segments of dead pids). Imports nothing of the cache or the server.

- `runtime_dir()`: the per-user directory of sockets (0700, ours).
- `socket_path(config)`: `service.socket`, else `<runtime dir>/<name>.sock`.
- `remove_stale_segments(directory)`: unlinks `ucm-<uid>-<pid>-...` files of
  dead pids in a segment directory (a tmpfs such as /dev/shm).
- `create_segment(directory, kind, nbytes)`: a new private file of `nbytes`
  named for this pid (so the cleanup above finds it), mapped shared.
- `record_segment_dir(sock)` / `recorded_segment_dir(sock)`: the segment
  directory of the service on `sock`, kept beside the socket, so that the
  next service on that socket removes a killed one's segments before it
  allocates its own (a tmpfs full of a dead arena would refuse the new one).
"""
from __future__ import annotations

import mmap
import os
import secrets
from typing import Optional

from ucm.config.schema import UcmConfig
from ucm.errors import UcmError


def runtime_dir() -> str:
    """The per-user directory of sockets (created 0700, checked to be ours)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "ucm") if base and os.access(base, os.W_OK) else f"/tmp/ucm-{os.getuid()}"
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UcmError(f"runtime directory {path!r} must be owned by uid {os.getuid()} with mode 0700 "
                       f"(found uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return path


def socket_path(config: UcmConfig) -> str:
    return config.service.socket or os.path.join(runtime_dir(), f"{config.service.name}.sock")


def segment_prefix() -> str:
    """How every shared-memory file of this user's services begins; the pid
    of the owner follows (`ucm-<uid>-<pid>-...`)."""
    return f"ucm-{os.getuid()}-"


def remove_stale_segments(directory: str) -> int:
    """Unlinks the segment files in `directory` whose owner pid is dead
    (left by killed services of this user); returns how many."""
    prefix = segment_prefix()
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # its owner is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


def create_segment(directory: str, kind: str, nbytes: int) -> tuple[str, mmap.mmap]:
    """(path, shared read-write mapping) of a new file `ucm-<uid>-<pid>-<kind>-<hex>`
    of `nbytes` in `directory`, created 0600; nothing is left behind when it fails."""
    path = os.path.join(directory, f"{segment_prefix()}{os.getpid()}-{kind}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _record_path(sock: str) -> str:
    return sock + ".segments"


def record_segment_dir(sock: str, directory: str) -> None:
    """Remembers, beside the socket `sock`, the directory of the service's
    segments (best effort: without it only the cleanup after start runs)."""
    tmp = f"{_record_path(sock)}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(directory)
        os.replace(tmp, _record_path(sock))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def recorded_segment_dir(sock: str) -> Optional[str]:
    """The segment directory an earlier service on `sock` recorded, or None."""
    try:
        with open(_record_path(sock)) as f:
            text = f.read(4096).strip()
    except OSError:
        return None
    return text if text and os.path.isabs(text) else None
