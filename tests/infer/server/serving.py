"""A real `milo serve` app on loopback in this process, for the tests that talk HTTP to a fake engine."""
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from milo_infer.server.app import create_app
from milo_infer.server.launch import DrainingServer


@dataclass
class Served:
    base: str  # http://127.0.0.1:PORT
    app: FastAPI
    server: DrainingServer
    thread: threading.Thread  # runs the server; it ends when the server does


@contextmanager
def serving(engine, *, drain_s: float = 5.0, close_s: float = 5.0, **options):
    """`create_app(engine, **options)` under `DrainingServer` on a free loopback port, stopped on exit."""
    app = create_app(engine, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = DrainingServer(app, uvicorn.Config(app, log_level="warning"), drain_s=drain_s, close_s=close_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", app, server, thread)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive()


def metric(base: str, name: str, headers=None) -> float:
    """One sample of the server's /metrics (``name`` with its labels, as Prometheus prints it)."""
    text = httpx.get(f"{base}/metrics", headers=headers).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not in /metrics"
    return values[0]
