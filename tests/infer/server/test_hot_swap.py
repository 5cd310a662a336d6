"""Hot swap: a store's new version (`milo update`) serves new requests while the requests planned before it
finish on the old one, with the answers each version gives alone; a version that cannot be mounted is
reported and the old one keeps serving; ``POST /admin/reload`` and ``/v1/models`` over it.

The tiny random Llama of the build tests (2 layers, the default tokenizer) builds and updates a store in
about a second; every answer is compared with an engine that mounts only the version it should come from.
"""
import gc
import json
import shutil
import threading
import weakref

import pytest
from fastapi.testclient import TestClient

from milo_infer.building.update import update_store
from milo_infer.runtime.engine import Engine
from milo_infer.runtime.planning import EngineSettings, Request
from milo_infer.server.app import create_app
from milo_infer.server.metrics import ServerMetrics
from milo_infer.server.reload import StoreReloader
from milo_store import IncompatibleStoreError, MiloStore
from milo_store.synthetic import block_location

from ..building.test_build import tiny, tiny_model_dir, tokenizer  # noqa: F401 (fixtures)
from ..building.test_update import build, demo

SETTINGS = EngineSettings(k=2, max_new_tokens=4)  # the tiny model has 128 positions
QUERIES = ["customer message number 3", "message number 12 about my account", "number 7", "my account number 20"]
KEY = "swap-key"


@pytest.fixture()
def versions(tiny, tmp_path):
    """A store at ``live`` (version 1), a copy of version 1 elsewhere, and version 2 (6 more demonstrations,
    3 removed) made by `update_store` in a third place: (live, v1 copy, v2 copy)."""
    live = build(tiny, tmp_path / "banking", [demo(i) for i in range(12)])
    first = shutil.copytree(live, tmp_path / "v1" / "banking")
    second = shutil.copytree(live, tmp_path / "v2" / "banking")
    update_store(second, tiny, add=[demo(i) for i in range(12, 18)], remove=["d1", "d4", "d5"], progress=False)
    return live, first, second


def publish(source, live) -> None:
    """Put the version at ``source`` at ``live`` (what `milo update` leaves there when it commits)."""
    shutil.rmtree(live)
    shutil.copytree(source, live)


def seen(answer) -> tuple:
    """What an answer shows of the version it came from: its text, its blocks and its context's length."""
    return answer.text, answer.blocks, answer.prefix_tokens


def reference_answers(loaded, path) -> dict[str, tuple]:
    """Each query's answer from an engine that mounts only the store at ``path``."""
    with MiloStore.open(path) as store:
        engine = Engine(loaded, {"banking": store}, SETTINGS)
        return {q: seen(a) for q, a in zip(QUERIES, engine.answer([engine.plan("banking", Request(q)) for q in QUERIES]))}


def test_requests_planned_before_a_swap_finish_on_their_version(tiny, versions, caplog):
    """Plans made before and after a swap, admitted together: one batch reads and rebuilds from both versions,
    each answer is its version's alone, and the old version is released with the last plan that held it
    (no cycle left for the garbage collector)."""
    live, first, second = versions
    want_old, want_new = reference_answers(tiny, first), reference_answers(tiny, second)
    assert want_old != want_new  # the versions answer differently: a mixed answer would show
    engine = Engine(tiny, {"banking": MiloStore.open(live)}, SETTINGS, max_rows=8)
    metrics = ServerMetrics(engine.stores)
    reloader = StoreReloader(engine, {"banking": str(live)}, MiloStore.open, metrics)
    old_plans = [engine.plan("banking", Request(q)) for q in QUERIES]
    v1 = engine.stores["banking"].version
    publish(second, live)
    caplog.set_level("INFO", logger="milo")
    [looked] = reloader.reload()
    assert looked.previous == v1 and looked.version == engine.stores["banking"].version != v1
    new_plans = [engine.plan("banking", Request(q)) for q in QUERIES]
    assert {p.mount.version for p in old_plans} == {v1} and {p.mount.version for p in new_plans} == {looked.version}
    batch, finished = engine.batch(), {}
    events = batch.admit(old_plans + new_plans)
    [admission] = batch.admissions
    assert set(admission.rebuild.fetched) == {old_plans[0].placement.prefix, new_plans[0].placement.prefix}
    while True:
        finished.update({id(e.plan): seen(e.answer) for e in events if e.finished})
        if not len(batch):
            break
        events = batch.step()
    assert [finished[id(p)] for p in old_plans] == [want_old[q] for q in QUERIES]
    assert [finished[id(p)] for p in new_plans] == [want_new[q] for q in QUERIES]
    retired = weakref.ref(old_plans[0].mount)
    gc.disable()
    try:
        del old_plans, events, admission
        assert retired() is None, "the old version is still held after its last request"
    finally:
        gc.enable()
    assert f"version {v1} released" in caplog.text
    assert metrics.reloads.labels("banking", "swapped")._value.get() == 1


def test_a_version_that_fails_to_mount_is_reported_and_the_old_one_serves(tiny, versions):
    live, first, second = versions
    engine = Engine(tiny, {"banking": MiloStore.open(live)}, SETTINGS)
    serving = engine.stores["banking"].version
    opened = []

    def open_store(location):
        opened.append(location)
        return MiloStore.open(location)

    reloader = StoreReloader(engine, {"banking": str(live)}, open_store, ServerMetrics(engine.stores))
    publish(second, live)
    chunk, _ = block_location(live, 0)
    chunk.write_bytes(chunk.read_bytes()[:-8])  # a truncated chunk: the mount refuses it
    [looked] = reloader.reload()
    assert looked.version == serving and looked.previous is None
    assert "cannot be mounted" in looked.error and "truncated" in looked.error and f"{serving} keeps serving" in looked.error
    assert engine.stores["banking"].version == serving
    assert seen(engine.answer([engine.plan("banking", Request(QUERIES[0]))])[0]) == reference_answers(tiny, first)[QUERIES[0]]
    reloader.reload(retry_failed=False)  # a poll does not mount the same broken version again
    assert len(opened) == 1
    publish(second, live)  # mended in place (the same version): a poll still skips it, an asked reload mounts it
    reloader.reload(retry_failed=False)
    assert len(opened) == 1
    [looked] = reloader.reload()
    assert looked.error is None and looked.previous == serving and len(opened) == 2


def test_a_store_of_another_model_is_refused_by_the_swap(tiny, versions, tmp_path):
    from milo_infer.bench import synthetic_model

    live, _, _ = versions
    engine = Engine(tiny, {"banking": MiloStore.open(live)}, SETTINGS)
    other = synthetic_model.random_model("tiny")
    paths = synthetic_model.synthetic_stores(tmp_path / "other", other, demos=8, block_size=4, demo_tokens=3,
                                             ratios=(0.5,))
    with MiloStore.open(next(iter(paths.values()))) as foreign:
        with pytest.raises(IncompatibleStoreError):
            engine.swap("banking", foreign)
    assert engine.stores["banking"].store.path == live


def test_admin_reload_and_models_over_http(tiny, versions):
    live, _, second = versions
    engine = Engine(tiny, {"banking": MiloStore.open(live)}, SETTINGS)
    app = create_app(engine, api_key=KEY, locations={"banking": str(live)}, open_store=MiloStore.open)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        v1 = engine.stores["banking"].version
        assert client.post("/admin/reload").status_code == 401
        [model] = client.get("/v1/models", headers=auth).json()["data"]
        assert model["id"] == "banking" and model["version"] == v1
        unchanged = client.post("/admin/reload", headers=auth)
        assert unchanged.status_code == 200 and unchanged.json()["data"] == [{"id": "banking", "version": v1,
                                                                              "previous": None}]
        for body, status, code in (({"model": "nope"}, 404, "model_not_found"), ({"model": 3}, 400, "invalid_value"),
                                   ({"store": "banking"}, 400, "invalid_value")):
            refused = client.post("/admin/reload", headers=auth, content=json.dumps(body))
            assert refused.status_code == status and refused.json()["error"]["code"] == code, body
        publish(second, live)
        swapped = client.post("/admin/reload", headers=auth, content=json.dumps({"model": "banking"})).json()["data"]
        v2 = engine.stores["banking"].version
        assert swapped == [{"id": "banking", "version": v2, "previous": v1}] and v2 != v1
        assert client.get("/v1/models", headers=auth).json()["data"][0]["version"] == v2
        answered = client.post("/v1/completions", headers=auth, json={"model": "banking", "prompt": QUERIES[0]})
        assert answered.status_code == 200
        (live / "zarr.json").write_text("{not json")
        failed = client.post("/admin/reload", headers=auth)
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "reload_failed"
        assert "banking" in failed.json()["error"]["message"] and f"{v2} keeps serving" in failed.json()["error"]["message"]
        assert client.get("/v1/models", headers=auth).json()["data"][0]["version"] == v2
        metrics = client.get("/metrics", headers=auth).text
        assert 'milo:store_reloads_total{model_name="banking",result="swapped"} 1.0' in metrics


def test_the_poll_swaps_a_new_version_in_by_itself(tiny, versions):
    live, _, second = versions
    engine = Engine(tiny, {"banking": MiloStore.open(live)}, SETTINGS)
    v1 = engine.stores["banking"].version
    reloader = StoreReloader(engine, {"banking": str(live)}, MiloStore.open, ServerMetrics(engine.stores),
                             interval_s=0.05)
    reloader.start()
    try:
        publish(second, live)
        for _ in range(200):
            if engine.stores["banking"].version != v1:
                break
            threading.Event().wait(0.05)
    finally:
        reloader.stop()
    assert engine.stores["banking"].version == MiloStore.current_version(live) != v1


def test_a_server_without_store_locations_refuses_a_reload():  # as milo serve --vllm is made
    from .fake_engine import FakeEngine

    with TestClient(create_app(FakeEngine())) as client:
        refused = client.post("/admin/reload")
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported"
        assert client.get("/v1/models").json()["data"][0]["version"] == "fake"
