"""Hot swap: a running server moves each store to its newest version without failing a request.

A `StoreReloader` looks at the version each store's location holds now (`MiloStore.current_version`:
one manifest GET for a store URL, the attributes file of a directory), every ``interval_s`` seconds and
whenever ``POST /admin/reload`` asks. A store whose version changed (`milo update`, a rebuild) is
opened with the server's mount options beside the version serving, and `Engine.swap` sends new
requests to it; requests planned before finish on the version they were planned against, which is
closed once none holds it. A version that cannot be opened or mounted is logged and reported, the old
one keeps serving, and the poll does not try that version again (a reload asked for does). A location
whose version cannot be read (a link down) is logged once until it can be read again.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from milo_store import MiloStore

from .metrics import ServerMetrics

log = logging.getLogger("milo.serve")
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reloaded:
    """One store after a look: the version serving new requests, the one it replaced (None: unchanged),
    or why the newer version found could not be mounted (then ``version`` is still the old one)."""
    store: str
    version: str
    previous: str | None = None
    error: str | None = None


class StoreReloader:
    """Swaps ``engine``'s stores (named as in ``locations``) to the versions their locations hold;
    ``open_store(location)`` opens one with the server's mount options; ``planning`` is the lock the
    server's planners hold while they use the tokenizer."""

    def __init__(self, engine, locations: dict[str, str], open_store: Callable[[str], MiloStore],
                 metrics: ServerMetrics, interval_s: float = 0.0, planning: threading.Lock | None = None):
        if interval_s < 0:
            raise ValueError(f"interval_s cannot be negative, got {interval_s}")
        if set(locations) != set(engine.stores):
            raise ValueError(f"locations name {sorted(locations)}, the engine mounts {sorted(engine.stores)}")
        self.engine, self.locations, self.open_store = engine, dict(locations), open_store
        self.metrics, self.interval_s = metrics, interval_s
        # mounting encodes the labels with the model's tokenizer: held as the server's planners hold it
        self.planning = planning or threading.Lock()
        self._lock = threading.Lock()  # one look at a time: a poll and an asked reload never mount twice
        self._failed: dict[str, tuple[str, str]] = {}  # store -> (version, why) of the last that failed to mount
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="milo-store-reload", daemon=True)

    def start(self) -> None:
        """Poll every ``interval_s`` seconds (no thread when it is 0: reloads only when asked)."""
        if self.interval_s > 0:
            self._thread.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop polling; a look under way (mounting a large store) is not waited for past ``timeout``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def reload(self, names: list[str] | None = None, *, retry_failed: bool = True) -> list[Reloaded]:
        """Look at ``names`` (default: every store) now and swap in the new versions found."""
        with self._lock:
            return [self._look(name, retry_failed) for name in (names or list(self.locations))]

    def _look(self, name: str, retry_failed: bool) -> Reloaded:
        serving = self.engine.stores[name].version
        location = self.locations[name]
        try:
            found = MiloStore.current_version(location)
        except Exception as e:
            return self._failure(name, serving, None, f"its version cannot be read at {location} ({type(e).__name__}: "
                                                      f"{e}); version {serving} keeps serving")
        if found == serving:
            self._failed.pop(name, None)
            return Reloaded(name, serving)
        failed = self._failed.get(name)
        if failed is not None and failed[0] == found and not retry_failed:  # a poll: counted once already
            return Reloaded(name, serving, error=failed[1])
        try:
            store = self.open_store(location)
            try:
                with self.planning:
                    self.engine.swap(name, store)
            except BaseException:
                store.close()
                raise
        except Exception as e:
            return self._failure(name, serving, found, f"version {found} at {location} cannot be mounted "
                                                       f"({type(e).__name__}: {e}); version {serving} keeps serving")
        self._failed.pop(name, None)
        self.metrics.reloads.labels(name, "swapped").inc()
        log.info("store %r: version %s serves new requests (was %s; the requests already in finish on it)",
                 name, store.version, serving)
        return Reloaded(name, store.version, previous=serving)

    def _failure(self, name: str, serving: str, found: str | None, why: str) -> Reloaded:
        """``found``: the version that failed to mount, None when none could be read."""
        if name not in self._failed or self._failed[name][0] != found:
            log.error("store %r: %s", name, why)  # once per version (or per unreadable spell), not every poll
        self._failed[name] = (found, why)
        self.metrics.reloads.labels(name, "failed").inc()
        return Reloaded(name, serving, error=why)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reload(retry_failed=False)
            except Exception:  # a bug: log it, keep serving, look again later
                log.exception("looking for new store versions failed")
