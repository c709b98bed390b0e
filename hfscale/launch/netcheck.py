"""One host's part of ``hfscale preflight --network`` (standard library only).

    python -m hfscale.launch.netcheck --me node1 --port 29555 --start 1764000000.0 --slot 1.5 --seconds 0.5 \\
        --rounds 3 --plan 0:10.0.0.2,2:10.0.0.4

It serves on ``--port`` from ``--start`` for ``--rounds`` slots of ``--slot`` seconds, and in each
round named in ``--plan`` (``round:address``) connects to that address at the slot's start and
measures, over one TCP connection: the round-trip time (the fastest of 30 one-byte exchanges), this
host's sending rate (``--seconds`` of data, counted by the receiver) and its receiving rate (the
same the other way). Each measurement is printed as one ``HFSCALE_NET {json}`` line. Rounds are
timed by the wall clock: the hosts' clocks must agree to well under a slot (NTP does).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time

MARK = "HFSCALE_NET"
CHUNK = 1 << 20
PINGS = 30
_DATA = b"\0" * CHUNK


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return buf


def _send_for(s: socket.socket, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(_DATA)


def _receive_all(s: socket.socket) -> tuple[int, float]:
    """Bytes until the peer's end of stream, and the seconds from the first byte to the last."""
    total, first = 0, None
    while True:
        part = s.recv(CHUNK)
        if not part:
            break
        if first is None:
            first = time.monotonic()
        total += len(part)
    return total, (time.monotonic() - first) if first is not None else 0.0


def _serve_one(conn: socket.socket, seconds: float) -> None:
    with conn:
        for _ in range(PINGS):
            conn.sendall(_recv_exact(conn, 1))
        received, took = _receive_all_framed(conn)
        conn.sendall(struct.pack("!Qd", received, took))
        _send_for(conn, seconds)


def _receive_all_framed(s: socket.socket) -> tuple[int, float]:
    """The client's upload: length-prefixed chunks, ended by a zero length (the socket stays open)."""
    total, first = 0, None
    while True:
        (n,) = struct.unpack("!I", _recv_exact(s, 4))
        if n == 0:
            break
        if first is None:
            first = time.monotonic()
        _recv_exact(s, n)
        total += n
    return total, (time.monotonic() - first) if first is not None else 0.0


def _send_framed_for(s: socket.socket, seconds: float) -> None:
    end = time.monotonic() + seconds
    header = struct.pack("!I", CHUNK)
    while time.monotonic() < end:
        s.sendall(header + _DATA)
    s.sendall(struct.pack("!I", 0))


def serve(port: int, until: float, seconds: float) -> threading.Thread:
    """Accept measurements until ``until`` (wall clock), each in its own thread."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("", port))
    srv.listen(64)
    srv.settimeout(0.2)

    def loop() -> None:
        with srv:
            while time.time() < until:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    continue
                conn.settimeout(None)
                threading.Thread(target=_serve_one, args=(conn, seconds), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def measure(address: str, port: int, seconds: float, deadline: float) -> dict:
    """RTT and both rates with the host serving at ``address``."""
    while True:
        try:
            s = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    with s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            s.sendall(b"p")
            _recv_exact(s, 1)
            rtts.append(time.perf_counter() - t0)
        s.settimeout(seconds * 4 + 10)
        _send_framed_for(s, seconds)
        sent, took = struct.unpack("!Qd", _recv_exact(s, 16))
        got, down_took = _receive_all(s)
    # the fastest round trip is the link's: a busy host only adds scheduling delay to the others
    return {"rtt_us": round(min(rtts) * 1e6, 1),
            "send_gbps": round(sent * 8 / took / 1e9, 4) if took > 0 else 0.0,
            "recv_gbps": round(got * 8 / down_took / 1e9, 4) if down_took > 0 else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hfscale.launch.netcheck")
    ap.add_argument("--me", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--start", type=float, required=True)
    ap.add_argument("--slot", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--plan", default="", help="round:address,... (the rounds this host connects in)")
    a = ap.parse_args(argv)
    until = a.start + a.rounds * a.slot + 1
    server = serve(a.port, until, a.seconds)
    for item in filter(None, a.plan.split(",")):
        r, _, address = item.partition(":")
        at = a.start + int(r) * a.slot
        time.sleep(max(0.0, at - time.time()))
        try:
            got = measure(address, a.port, a.seconds, at + a.slot / 3)
            print(f"{MARK} " + json.dumps({"from": a.me, "to": address, "round": int(r), **got}), flush=True)
        except OSError as e:
            print(f"{MARK} " + json.dumps({"from": a.me, "to": address, "round": int(r), "error": str(e)}), flush=True)
    server.join(max(0.0, until - time.time()) + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
