"""An HTTP proxy on 127.0.0.1 in front of an object-store server: injects faults, or throttles the link.

Used by the remote tests (faults) and tools/bench_remote.py (throttling). Point a client at it with
``AWS_ENDPOINT_URL=proxy.url``. Both are simulations of a real network and are reported as such.

- faults: for ``fraction`` of GET requests (seeded), one of ``503`` (a SlowDown error), ``reset``
  (the connection is reset before any answer), ``stall`` (no answer for ``stall_s``, then closed),
  ``truncate`` (the full Content-Length announced, half the body sent, then closed), ``corrupt``
  (one byte of a factor range flipped, length intact: only what a checksum can catch).
- throttle: every response body goes through one shared token bucket of ``rate`` bytes/s, like a
  single link all connections share.
"""
import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("503", "reset", "stall", "truncate", "corrupt")
SLICE = 64 << 10  # bytes sent per throttle step


class LoopbackProxy:
    def __init__(self, upstream: str, *, faults=(), fraction: float = 0.0, seed: int = 0, stall_s: float = 3.0,
                 rate: float | None = None):
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; expected some of {FAULTS}")
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self.faults, self.fraction, self.stall_s, self.rate = tuple(faults), fraction, stall_s, rate
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.link_free = 0.0  # when the simulated link can start sending the next slice
        self.counts = {"requests": 0, "gets": 0, "body_bytes": 0, **{f: 0 for f in FAULTS}}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _pick_fault(self, method: str) -> str | None:
        with self.lock:
            self.counts["requests"] += 1
            if method != "GET":
                return None
            self.counts["gets"] += 1
            if self.faults and self.rng.random() < self.fraction:
                fault = self.rng.choice(self.faults)
                self.counts[fault] += 1
                return fault
        return None

    def _send_throttled(self, wfile, body: bytes) -> None:
        if self.rate is None:
            wfile.write(body)
            return
        for at in range(0, len(body), SLICE):
            piece = body[at:at + SLICE]
            with self.lock:
                start = max(time.perf_counter(), self.link_free)
                self.link_free = start + len(piece) / self.rate
                done = self.link_free
            time.sleep(max(0.0, done - time.perf_counter()))
            wfile.write(piece)

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._pick_fault(self.command)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault == "stall":
                    time.sleep(proxy.stall_s)
                    self.close_connection = True
                    return
                if fault == "503":
                    msg = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault == "truncate" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.close_connection = True
                    return
                if fault == "corrupt" and resp.status == 206 and data:
                    flip = bytearray(data)
                    flip[len(flip) // 2] ^= 0x5A
                    data = bytes(flip)
                with proxy.lock:
                    proxy.counts["body_bytes"] += len(data)
                proxy._send_throttled(self.wfile, data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
