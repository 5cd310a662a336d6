"""Mount the stores a server is started with, and run its app under uvicorn with a graceful drain."""
import logging
import signal
import time
from pathlib import PurePosixPath

import uvicorn

from milo_store import MiloStore
from milo_store.errors import StoreError

log = logging.getLogger("milo.serve")


def store_name(location: str) -> str:
    """The name clients use for a store: its directory's or URL's basename (``stores/banking77/`` -> banking77)."""
    return PurePosixPath(str(location).rstrip("/")).name


def store_locations(locations: list[str]) -> dict[str, str]:
    """Each store's location by the name clients use; two stores of one name are refused (a client could not
    tell them apart)."""
    names = [store_name(loc) for loc in locations]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise StoreError(f"two stores share the name {clash[0]!r} (the basename clients ask for): rename one")
    return dict(zip(names, locations))


def mount_stores(locations: list[str], **options) -> dict[str, MiloStore]:
    """Every store opened once (``options``: `MiloStore.open`'s keywords), by name (`store_locations`)."""
    stores: dict[str, MiloStore] = {}
    try:
        for name, location in store_locations(locations).items():
            stores[name] = MiloStore.open(location, **options)
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


CLOSE_TIMEOUT_S = 10.0  # after the drain: how long the handlers may take to write their last bytes


class DrainingServer(uvicorn.Server):
    """uvicorn with milo's drain. On SIGTERM or SIGINT: ``/health`` and new requests answer 503 at once while
    the socket stays open, requests already in (being planned, queued or running) go on for up to
    ``drain_s`` seconds, those still unanswered then end with a 503 ``shutting_down`` (an error frame
    then ``[DONE]`` when streaming), and the server closes and returns normally, so the process exits 0
    (uvicorn's own handler would re-raise the signal). A second SIGINT forces. An engine loop that
    cannot go on ends the server too, with ``exit_code`` 1. Once closing, uvicorn gives the handlers
    ``close_s`` seconds to write their last bytes (its ``timeout_graceful_shutdown``: a backstop only)."""

    def __init__(self, app, config: uvicorn.Config, *, drain_s: float, close_s: float = CLOSE_TIMEOUT_S):
        config.timeout_graceful_shutdown = close_s
        super().__init__(config)
        self.app_state, self.engine_loop, self.drain_s = app.state, app.state.engine_loop, drain_s
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_s
            self.engine_loop.drain()
        elif sig == signal.SIGINT:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        loop = self.engine_loop
        if loop.failure is not None and not self.exit_code:  # it answers all it holds; uvicorn waits for those
            log.error("exiting with status 1, so that a supervisor restarts the server: the engine loop failed (%s)",
                      loop.failure)
            self.exit_code = 1
            self.should_exit = True
        elif self.drain_deadline is not None and not self.should_exit:
            if loop.idle and not self.app_state.preparing:
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                log.warning("the %g s drain is over: the requests still unanswered end with 503 shutting_down",
                            self.drain_s)
                loop.stop(timeout=0)  # the loop answers them once its step under way is done
                self.should_exit = True
        return await super().on_tick(counter)


def serve(app, *, host: str, port: int, drain_s: float) -> int:
    """Run ``app`` (from `create_app`) until a signal, then drain for at most ``drain_s`` seconds; the exit
    status: 0, or 1 when the engine loop failed."""
    server = DrainingServer(app, uvicorn.Config(app, host=host, port=port, log_level="info"), drain_s=drain_s)
    server.run()
    return server.exit_code
