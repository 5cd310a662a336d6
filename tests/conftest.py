"""Fixtures shared by the store and infer tests: an S3 endpoint on loopback."""
import logging
import os
import urllib.request
import uuid

import pytest


@pytest.fixture(scope="session")
def s3_server():
    """(bucket URL, environment) of an S3 endpoint: MILO_TEST_S3_URL's (credentials from the environment),
    else moto's server on loopback, started here and stopped at the end of the session."""
    if url := os.environ.get("MILO_TEST_S3_URL"):
        yield url.rstrip("/"), {}
        return
    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "milo-test", "AWS_SECRET_ACCESS_KEY": "milo-test-secret", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ALLOW_HTTP": "true"}
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/milo-test", method="PUT"), timeout=10).close()
    yield "s3://milo-test", env
    server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch):
    """A fresh prefix on the S3 endpoint, its environment set (subprocesses inherit it)."""
    base, env = s3_server
    for k, v in {**env, "MILO_REMOTE_RETRIES": "3"}.items():
        monkeypatch.setenv(k, v)
    return f"{base}/{uuid.uuid4().hex[:12]}"
