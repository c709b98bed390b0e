"""The launcher's end of the nodes' heartbeat line: one TCP connection per node's keeper, so that a
job's heartbeats cost the shared file system nothing per second, whatever the node count.

Each node's keeper (hfscale.launch.node.keeper) reads ``<run dir>/beat.addr`` once (``<port>
<token> <address>``, this user's only), connects to the launcher at the address its session shows
(``$SSH_CONNECTION``'s first word under pdsh, ``$SLURM_LAUNCH_NODE_IPADDR`` under srun), sends
``HFSBEAT1 <token> <host>``, and gets ``ok``. From then on it sends one byte every few seconds
and this server answers each with one byte:

- the keeper learns that its launcher lives from the answers: a connection that closes (the
  launcher was killed: its kernel closes its sockets) stops the node's job at once, answers that
  stop for ``lost_after_s`` (its host lost, frozen) stop it then;
- the launcher learns that each node lives from the bytes it receives (``last_seen``); a closed
  connection means the node's line ended (its keeper goes with it), or its keeper died;
- an attempt that ends says so before it closes the line (``x``): a keeper still running then (its
  node was not reached by the stop: a slurmd-less node) watches ``launcher.beat`` again, which the
  next attempt rewrites, instead of taking the close for its launcher's death (under Slurm that
  requeues the job).

A keeper that cannot connect or is not answered ``ok`` (a firewall, no room for more connections
here) watches ``launcher.beat`` in the run directory instead, as before this line existed; so do
the hosts of an older hfscale. Input from the network is hostile: a hello is one line of at most
``HELLO_CAP`` bytes within ``HELLO_S`` seconds, with the token compared in constant time and a
host name of the beat files' alphabet, or the connection is closed; at most ``max_conns``
connections are kept. A thread of the launching process; no processes.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import re
import resource
import secrets
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from hfscale.core.atomic_files import write_files
from hfscale.launch.run_dir import BEAT_ADDR

HELLO = b"HFSBEAT1"
HELLO_CAP = 300
HELLO_S = 10.0
ACCEPTS_PER_WAKE = 512
_HOST = re.compile(rb"^[A-Za-z0-9_.:-]{1,255}$")


class _Conn:
    __slots__ = ("sock", "host", "buf", "opened")

    def __init__(self, sock: socket.socket, opened: float):
        self.sock, self.host, self.buf, self.opened = sock, None, b"", opened


def _listener() -> socket.socket:
    if socket.has_dualstack_ipv6():
        with contextlib.suppress(OSError):
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=4096)
    return socket.create_server(("", 0), backlog=4096)


def _own_address() -> str:
    """An address of this host for keepers whose session shows none (a fallback only)."""
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def _room_for(n: int) -> int:
    """Raise this process's open-file limit toward ``n`` more files (never above the hard limit);
    the connections this server may keep."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return n if soft == resource.RLIM_INFINITY else max(0, min(n, soft - 256))


class BeatServer:
    """Listens for ``hosts`` keepers (a thread) and answers their beats until ``stop()``.
    ``start`` returns None, after saying why, when no socket can be opened here: the keepers then
    use the run directory's beat files."""

    def __init__(self, run_dir: str | Path, hosts: int, clock: Callable[[], float] = time.monotonic):
        self.run_dir = Path(run_dir)
        self.token = secrets.token_hex(16)
        self.max_conns = _room_for(2 * max(1, hosts) + 16)  # spares and relaunched lines connect too
        self._clock = clock
        self._sock = _listener()
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # host -> when its last byte came
        self._closed: dict[str, float] = {}  # host -> when its connection closed (and it has none open)
        self._open: dict[str, int] = {}  # host -> its connections open now (a relaunched line's keeper, briefly two)
        self.refused = 0  # connections closed for a bad, slow or extra hello
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="hfscale-beat-server")

    @classmethod
    def start(cls, run_dir: str | Path, hosts: int, echo: Callable[[str], None]) -> "BeatServer | None":
        server = None
        try:
            server = cls(run_dir, hosts)
            write_files(Path(run_dir), {BEAT_ADDR: f"{server.port} {server.token} {_own_address()}\n"}, mode=0o600)
        except OSError as e:
            if server is not None:  # its address could not be written: no keeper will connect
                server._sel.close()
                server._sock.close()
            echo(f"hfscale: warning: no heartbeat line to the nodes ({e.strerror or e}); they watch "
                 f"the run directory's heartbeat file instead")
            return None
        server._thread.start()
        return server

    # ---- what the launch asks ----------------------------------------------------------------
    def last_seen(self) -> dict[str, float]:
        """Host -> when (this process's monotonic clock) its keeper last beat, for hosts that connected."""
        with self._lock:
            return dict(self._seen)

    def closed(self) -> dict[str, float]:
        """Host -> when its keeper's connection closed, for hosts with none open now."""
        with self._lock:
            return dict(self._closed)

    def stop(self) -> None:
        """The attempt is over: each keeper is told so (``x``), then the line closes."""
        self._done.set()
        self._thread.join(5)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                if conn.host is not None:
                    conn.sock.send(b"x")
                conn.sock.close()
        self._conns.clear()
        with contextlib.suppress(OSError):
            self._sel.close()
        with contextlib.suppress(OSError):
            self._sock.close()

    # ---- the thread ------------------------------------------------------------------------------
    def _serve(self) -> None:
        last_sweep = self._clock()
        while not self._done.is_set():
            try:
                events = self._sel.select(timeout=0.5)
            except OSError:
                return
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            now = self._clock()
            if now - last_sweep >= 1.0:
                last_sweep = now
                for conn in [c for c in self._conns.values() if c.host is None and now - c.opened > HELLO_S]:
                    self._drop(conn, refused=True)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of files: the keeper is not answered ok and watches the file instead
                return
            if len(self._conns) >= self.max_conns:
                self.refused += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, self._clock())
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        if conn.host is None:
            conn.buf += data
            if b"\n" not in conn.buf:
                if len(conn.buf) > HELLO_CAP:
                    self._drop(conn, refused=True)
                return
            line, _, rest = conn.buf.partition(b"\n")
            parts = line.split(b" ")
            if (len(line) > HELLO_CAP or len(parts) != 3 or parts[0] != HELLO or rest
                    or not hmac.compare_digest(parts[1], self.token.encode()) or not _HOST.match(parts[2])):
                self._drop(conn, refused=True)
                return
            conn.host, conn.buf = parts[2].decode(), b""
            self._open[conn.host] = self._open.get(conn.host, 0) + 1
            with self._lock:
                self._seen[conn.host] = self._clock()
                self._closed.pop(conn.host, None)
            self._send(conn, b"ok\n")
            return
        with self._lock:
            self._seen[conn.host] = self._clock()
        self._send(conn, b"b" * min(len(data), 16))

    def _send(self, conn: _Conn, data: bytes) -> None:
        try:
            conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            pass  # its buffer is full: the keeper hears the next answer
        except OSError:
            self._drop(conn)

    def _drop(self, conn: _Conn, refused: bool = False) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return  # dropped already
        self.refused += refused
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()
        if conn.host is not None:
            self._open[conn.host] -= 1
            if not self._open[conn.host]:
                with self._lock:
                    self._closed[conn.host] = self._clock()


def remove_addr(run_dir: str | Path) -> None:
    """The address file goes with the launch (a later launch's keepers must not find it)."""
    with contextlib.suppress(OSError):
        os.unlink(Path(run_dir) / BEAT_ADDR)
