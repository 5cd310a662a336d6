"""Faults between client and S3 server (a proxy on loopback): answers stay identical or the error is
clear; never wrong bytes. Also wrong credentials, as the server's 403 reaches the client."""
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from milo_store import CompressionConfig, MiloStore, StoreError
from milo_store.blockcache import BlockCache
from milo_store.synthetic import build_synthetic_store

from .conftest import LAYOUT
from .test_blockcache import MANY_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from loopback_proxy import LoopbackProxy  # noqa: E402

BATCHES = [[0, 5, 9], [1, 2, 3], [11, 7], [4, 6, 8, 10]]


@pytest.fixture
def remote_store(tmp_path, s3_url):
    url = build_synthetic_store(s3_url, LAYOUT, MANY_TOKENS, CompressionConfig(ratio=0.5), seed=11)
    with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / "ref")) as s:
        want = [s.block(i).clone() for i in range(s.num_blocks)]
    return url, want


@pytest.mark.parametrize("fault", ["503", "reset", "stall", "truncate", "corrupt"])
def test_faulty_link_never_gives_wrong_bytes(tmp_path, remote_store, monkeypatch, fault):
    url, want = remote_store
    monkeypatch.setenv("MILO_REMOTE_TIMEOUT", "1")
    with LoopbackProxy(os.environ["AWS_ENDPOINT_URL"], faults=[fault], stall_s=1.5, seed=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        outcomes = []
        for trial in range(1 if fault == "stall" else 3):  # a stall costs a client timeout
            proxy.fraction = 0.0  # mount cleanly, then fault a third of the range GETs
            with MiloStore.open(url, tier="disk", block_cache=BlockCache(tmp_path / f"c{trial}")) as s:
                proxy.fraction = 0.35
                for batch in BATCHES:
                    try:
                        got = s.blocks(batch)
                    except StoreError as e:
                        assert url in str(e) and "\n" not in str(e)
                        outcomes.append("error")
                        continue
                    assert all(torch.equal(want[i], g) for i, g in zip(batch, got))  # never wrong bytes
                    outcomes.append("ok")
        assert proxy.counts[fault] > 0, proxy.counts
        assert proxy.counts["gets"] < 200  # bounded retries
    if fault in ("503", "reset", "corrupt"):  # retried (by obstore, or refetched on a checksum mismatch)
        assert outcomes.count("ok") >= len(outcomes) // 2, outcomes


def test_faults_while_mounting_give_a_clear_error_or_the_store(tmp_path, remote_store, monkeypatch):
    url, want = remote_store
    monkeypatch.setenv("MILO_REMOTE_TIMEOUT", "1")
    with LoopbackProxy(os.environ["AWS_ENDPOINT_URL"], faults=["503", "reset", "truncate"], fraction=0.3, seed=5) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        for trial in range(3):
            try:
                with MiloStore.open(url, tier="host", block_cache=BlockCache(tmp_path / f"c{trial}")) as s:
                    assert all(torch.equal(w, s.block(i)) for i, w in enumerate(want))
            except StoreError as e:
                assert url in str(e) and "\n" not in str(e)


def test_wrong_credentials(tmp_path, remote_store, monkeypatch):
    """moto accepts any key, so a proxy answers 403 as S3 does for a bad key; the error names the URL."""
    url, _ = remote_store

    with LoopbackProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        def forbidden(handler_self):
            msg = b"<Error><Code>InvalidAccessKeyId</Code><Message>bad key</Message></Error>"
            handler_self.send_response(403)
            handler_self.send_header("Content-Length", str(len(msg)))
            handler_self.end_headers()
            handler_self.wfile.write(msg)
        handler = proxy.server.RequestHandlerClass
        handler.do_GET = handler.do_HEAD = forbidden
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.raises(StoreError, match=f"{url}: access denied"):
            MiloStore.open(url)


def test_an_endpoint_that_never_answers_is_named_within_the_timeout(monkeypatch):
    """It accepts connections (the kernel completes them from the backlog) and never replies."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        endpoint = f"http://127.0.0.1:{mute.getsockname()[1]}"
        for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "milo-test",
                            "AWS_SECRET_ACCESS_KEY": "milo-test-secret", "AWS_REGION": "us-east-1",
                            "MILO_REMOTE_TIMEOUT": "1"}.items():
            monkeypatch.setenv(name, value)
        started = time.monotonic()
        with pytest.raises(StoreError, match=f"s3://milo-mute/s: the object store is not answering: no reply from "
                                             f"{endpoint}/milo-mute/s/manifest.json within 1 s"):
            MiloStore.open("s3://milo-mute/s")
        assert time.monotonic() - started < 2.5  # one timeout, not one per retry
