"""Page-locked host tier, with a stand-in for the CUDA runtime: registration is undone exactly once,
after the device is idle, also when a store is dropped without close(); a failed registration clears
CUDA's sticky error and leaves the tier pageable but correct."""
import gc

import pytest
import torch

from milo_store import MiloStore


class FakeCudart:
    def __init__(self, register_error=0):
        self.calls, self.register_error = [], register_error

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.calls.append(("register", ptr))
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):
        self.calls.append(("get_last_error", None))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: fake.calls.append(("synchronize", None)))
    return fake


def test_close_unregisters_once_after_synchronising(small_store, cudart):
    store = MiloStore.open(small_store, tier="host", pin=True)
    ptr = store.block(0).data_ptr()  # the registered allocation starts with block 0
    store.close()
    store.close()
    assert cudart.calls == [("register", ptr), ("synchronize", None), ("unregister", ptr)]


def test_a_store_dropped_without_close_is_unregistered(small_store, cudart):
    store = MiloStore.open(small_store, tier="host", pin=True)
    ptr = store.block(0).data_ptr()  # the registered allocation starts with block 0
    del store
    gc.collect()
    assert cudart.calls == [("register", ptr), ("synchronize", None), ("unregister", ptr)]


def test_a_failed_registration_clears_the_error_and_stays_correct(small_store, cudart):
    cudart.register_error = 2
    with pytest.warns(UserWarning, match="page-locking failed"):
        store = MiloStore.open(small_store, tier="host", pin=True)
    with store, MiloStore.open(small_store, tier="disk", pin=False) as disk:
        assert all(torch.equal(store.block(i), disk.block(i)) for i in range(store.num_blocks))
    assert [c for c, _ in cudart.calls] == ["register", "get_last_error"]  # never unregistered
