"""Fixtures shared by the store and infer tests: an S3 endpoint on loopback. And the count of test files a
session collected against those on disk (`test_collection.py`): a folder pytest skips by name (``build``,
``dist``, ``venv``, ...) would otherwise hide its tests without a word."""
import logging
import os
import urllib.request
import uuid
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
COLLECTED_FILES: set[Path] = set()  # the test modules this session reached


def test_files_on_disk() -> set[Path]:
    return {p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts}


def pytest_collectreport(report):
    """Every test module the session reached, also one skipped as a whole (vLLM's where vLLM is absent)."""
    path = Path(str(report.fspath)).resolve()
    if "::" not in report.nodeid and path.name.startswith("test_") and path.suffix == ".py":
        COLLECTED_FILES.add(path)


def missing_test_files() -> list[str]:
    """Test files on disk this session did not collect, relative to the repository."""
    return sorted(str(p.relative_to(TESTS.parent)) for p in test_files_on_disk() - COLLECTED_FILES)


def pytest_terminal_summary(terminalreporter, config):
    """One line in every full run (and in CI's log): how many test files it collected of those on disk."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    missing = missing_test_files()
    line = f"test files: {len(test_files_on_disk()) - len(missing)} collected of {len(test_files_on_disk())} on disk"
    terminalreporter.write_line(line + (f"; not collected: {', '.join(missing)}" if missing else ""))


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
