"""The service's event loop: one thread answers every connection, a small
worker pool runs the requests that may block.

Generic over a `Handler` (ucm.service.server.handlers in the service, a fake in
tests): the loop owns the sockets, framing, output buffering and ordering;
the handler owns what the requests mean.

Threads
- The loop thread (`run`) accepts, reads, decodes frames, answers requests
  whose op the handler calls non-blocking, and writes replies. Nothing on
  it may wait on I/O, the network or a lock held across either.
- Worker threads (`workers` of them) run blocking requests and the
  handler's `disconnect` (giving back what a closed connection owned).
  One request per connection runs at a time, so replies keep the order of
  the requests; other connections go on meanwhile.
- The watchdog thread logs, once per request, a request that has run for
  `watchdog_s`, with every thread's stack.

Output: reply bytes a client does not take at once are buffered; past
`out_limit_bytes` the connection is not read from until it takes them (a
client that stops reading cannot grow the service's memory).

Lock order: `_lock` (the running-request table), then nothing.
"""
from __future__ import annotations

import faulthandler
import logging
import queue
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Protocol

from ucm.service import protocol as proto

log = logging.getLogger(__name__)


class Handler(Protocol):
    """What a loop asks of the service it runs."""

    def connect(self, cid: int) -> Any:
        """The state of new connection `cid` (loop thread; must not block)."""

    def blocking(self, op: str) -> bool:
        """Whether `op` may block (then it runs on a worker). Unknown ops:
        False (the handler refuses them)."""

    def handle(self, state: Any, rid: int, op: str, args: Any) -> bytes:
        """The packed reply to request `rid` (never raises)."""

    def disconnect(self, state: Any) -> None:
        """Gives back what the connection owned (a worker thread)."""


class Conn:
    """One client connection, as the loop sees it."""

    __slots__ = ("sock", "id", "state", "decoder", "out", "busy", "closing", "dropped", "given_back")

    def __init__(self, sock: socket.socket, cid: int, state: Any, max_frame_bytes: int) -> None:
        self.sock = sock
        self.id = cid
        self.state = state  # the handler's
        self.decoder = proto.FrameDecoder(max_frame_bytes)
        self.out = bytearray()  # reply bytes the socket did not take yet
        self.busy = False  # a request (or the disconnect) of it runs on a worker
        self.closing = False  # no more requests; drop once the running one is done
        self.dropped = False  # its disconnect is queued or done
        self.given_back = False  # the handler's disconnect ran


class EventLoop:
    """Serves `listener` (a bound, listening stream socket) with `handler`."""

    def __init__(self, listener: socket.socket, handler: Handler, *, workers: int, max_frame_bytes: int,
                 poll_spin_s: float = 0.0, watchdog_s: float = 10.0, out_limit_bytes: int = 1 << 20,
                 idle_exit_s: Optional[float] = None) -> None:
        """`idle_exit_s`: `run` returns once no connection has been open for
        that long (a private service); None: only `stop` ends it."""
        self.listener = listener
        self.handler = handler
        self.max_frame_bytes = max_frame_bytes
        self.poll_spin_s = poll_spin_s
        self.watchdog_s = watchdog_s
        self.out_limit_bytes = out_limit_bytes
        self.idle_exit_s = idle_exit_s
        self._conns: dict[int, Conn] = {}  # the loop thread's
        self._next_conn = 1
        self._last_active = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float, bool]] = {}  # worker thread -> (op, start, logged)
        self._done: "queue.SimpleQueue[tuple[Conn, Optional[bytes]]]" = queue.SimpleQueue()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ucm-serve")
        self._closed = False

    @property
    def connections(self) -> int:
        return len(self._conns)

    def stop(self) -> None:
        """Ends `run` (any thread, a signal handler too)."""
        self._stop.set()
        try:
            self._wake_w.send(b"s")
        except OSError:
            pass

    def run(self) -> None:
        """Serves until `stop` (or idle, see idle_exit_s). Call `close` after."""
        self.listener.setblocking(False)
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        threading.Thread(target=self._watchdog, name="ucm-serve-watchdog", daemon=True).start()
        busy_until = 0.0
        while not self._stop.is_set():
            # Poll while requests keep coming (see service.poll_spin_us).
            events = self._sel.select(0 if time.perf_counter() < busy_until else 0.5)
            if events:
                busy_until = time.perf_counter() + self.poll_spin_s
            elif time.perf_counter() < busy_until:
                continue
            if not events and self._idle():
                log.info("ucm serve: idle for %.1f s, exiting", self.idle_exit_s)
                break
            for key, mask in events:
                if key.data is None:
                    self._accept()
                elif key.data == "wake":
                    self._completions()
                else:
                    conn = key.data
                    if mask & selectors.EVENT_WRITE:
                        self._flush_out(conn)
                    if mask & selectors.EVENT_READ and not conn.closing:
                        self._readable(conn)

    def close(self) -> None:
        """After `run`: waits for the requests in flight, gives back what
        every connection owned and closes them. The listener is the
        caller's."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)  # requests in flight finish first
        for conn in list(self._conns.values()):  # no worker runs any more
            self._forget(conn)
            conn.dropped = True
            self._disconnect(conn)  # once: a disconnect the shutdown cancelled too
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- connections -------------------------------------------------------
    def _idle(self) -> bool:
        return (self.idle_exit_s is not None and not self._conns
                and time.monotonic() - self._last_active > self.idle_exit_s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self._stop.is_set():
                    return
                raise
            client.setblocking(False)
            cid = self._next_conn
            self._next_conn += 1
            conn = Conn(client, cid, self.handler.connect(cid), self.max_frame_bytes)
            self._conns[cid] = conn
            self._last_active = time.monotonic()
            self._sel.register(client, selectors.EVENT_READ, conn)

    def _readable(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(max(65536, conn.decoder.need()))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_conn(conn)
            return
        conn.decoder.feed(data)
        self._dispatch(conn)

    def _close_conn(self, conn: Conn, after_send: bool = False) -> None:
        """No more requests from `conn`; what it owns is given back once no
        request of it runs any more (and, with after_send, once its last
        reply left)."""
        conn.closing = True
        if after_send and conn.out:
            return
        self._forget(conn)
        if not conn.busy:
            self._drop(conn)
        # else _completions drops it once its request is done

    def _forget(self, conn: Conn) -> None:
        """Stops watching `conn` (a closed socket stays readable)."""
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, conn: Conn) -> None:
        """Closes `conn` and gives back what it owned, on a worker (giving
        back reservations touches the adapters)."""
        if conn.dropped:
            return
        conn.dropped = True
        conn.busy = True
        try:
            self._pool.submit(self._run_disconnect, conn)
        except RuntimeError:  # the pool is shut down: close() gives it back
            pass

    def _run_disconnect(self, conn: Conn) -> None:
        self._track("disconnect")
        try:
            self._disconnect(conn)
        finally:
            self._untrack()
            self._complete(conn, None)

    def _disconnect(self, conn: Conn) -> None:
        if conn.given_back:
            return
        conn.given_back = True
        try:
            self.handler.disconnect(conn.state)
        except Exception:  # a bug there must not take the service down
            log.exception("ucm serve: giving back what connection %d owned failed", conn.id)
        finally:
            try:
                conn.sock.close()
            except OSError:
                pass

    # ---- requests ----------------------------------------------------------
    def _dispatch(self, conn: Conn) -> None:
        """Answers the buffered requests of `conn` until one goes to a
        worker (the connection then waits for it: requests stay in order)."""
        while not conn.busy and not conn.closing and len(conn.out) <= self.out_limit_bytes:
            try:
                frame = conn.decoder.next()
            except proto.ProtocolError as exc:
                log.warning("ucm serve: connection %d: %s; closing it", conn.id, exc)
                self._reply(conn, proto.pack([0, False, str(exc)]))
                self._close_conn(conn, after_send=True)
                return
            if frame is proto.NEED_MORE:
                return
            if not (isinstance(frame, list) and len(frame) == 3 and type(frame[0]) is int
                    and isinstance(frame[1], str)):
                self._reply(conn, proto.pack([0, False, "request must be [id:int, op:str, args:map]"]))
                continue
            rid, op, args = frame
            if self.handler.blocking(op):
                conn.busy = True
                self._pool.submit(self._run_blocking, conn, rid, op, args)
                return
            self._reply(conn, self.handler.handle(conn.state, rid, op, args))

    def _run_blocking(self, conn: Conn, rid: int, op: str, args: Any) -> None:
        self._track(op)
        try:
            out = self.handler.handle(conn.state, rid, op, args)
        except BaseException as exc:  # never leave the connection busy
            out = proto.pack([rid, False, f"internal error: {type(exc).__name__}"])
        finally:
            self._untrack()
        self._complete(conn, out)

    def _track(self, op: str) -> None:
        with self._lock:
            self._running[threading.get_ident()] = (op, time.monotonic(), False)

    def _untrack(self) -> None:
        with self._lock:
            self._running.pop(threading.get_ident(), None)

    def _complete(self, conn: Conn, out: Optional[bytes]) -> None:
        """Hands a worker's result to the loop thread (None: a disconnect)."""
        self._done.put((conn, out))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the wake pipe is full (the loop is awake anyway) or closed

    def _completions(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while True:
            try:
                conn, out = self._done.get_nowait()
            except queue.Empty:
                return
            if out is None:  # a disconnect finished
                self._conns.pop(conn.id, None)
                self._last_active = time.monotonic()
                continue
            conn.busy = False
            if conn.closing:  # its client hung up meanwhile
                self._forget(conn)
                self._drop(conn)
                continue
            self._reply(conn, out)
            self._dispatch(conn)

    def _watchdog(self) -> None:
        """Logs, once per request, an operation that has run for
        `watchdog_s`, with every thread's stack: what a request that clients
        will give up on waits for."""
        while not self._stop.wait(min(1.0, self.watchdog_s / 2)):
            now = time.monotonic()
            with self._lock:
                stuck = [(t, op, now - t0) for t, (op, t0, told) in self._running.items()
                         if not told and now - t0 > self.watchdog_s]
                for t, op, _ in stuck:
                    self._running[t] = (op, self._running[t][1], True)
            for t, op, age in stuck:
                log.warning("ucm serve: %s has run for %.1f s (thread %d); stacks follow", op, age, t)
                faulthandler.dump_traceback(all_threads=True)

    # ---- output ------------------------------------------------------------
    def _reply(self, conn: Conn, data: bytes) -> None:
        if conn.dropped:
            return
        if conn.out:
            conn.out += data
            if len(conn.out) > self.out_limit_bytes and not conn.closing:
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)  # stop reading it
            return
        try:
            n = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close_conn(conn)
            return
        if n < len(data):
            conn.out += data[n:]
            reading = selectors.EVENT_READ if len(conn.out) <= self.out_limit_bytes and not conn.closing else 0
            self._sel.modify(conn.sock, reading | selectors.EVENT_WRITE, conn)

    def _flush_out(self, conn: Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            conn.out.clear()
            self._close_conn(conn)
            return
        throttled = len(conn.out) > self.out_limit_bytes
        del conn.out[:n]
        if not conn.out:
            if conn.closing:
                self._close_conn(conn)
            else:
                self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        elif throttled and len(conn.out) <= self.out_limit_bytes and not conn.closing:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        if throttled and len(conn.out) <= self.out_limit_bytes and not conn.closing:
            self._dispatch(conn)  # the requests it buffered meanwhile
