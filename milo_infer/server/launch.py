"""Mount the stores a server is started with, and run its app under uvicorn with a graceful drain."""
import logging
import signal
from pathlib import PurePosixPath

import uvicorn

from milo_store import MiloStore
from milo_store.errors import StoreError

log = logging.getLogger("milo.serve")


def store_name(location: str) -> str:
    """The name clients use for a store: its directory's or URL's basename (``stores/banking77/`` -> banking77)."""
    return PurePosixPath(str(location).rstrip("/")).name


def mount_stores(locations: list[str], **options) -> dict[str, MiloStore]:
    """Every store opened once (``options``: `MiloStore.open`'s keywords), by name; two stores of one name are
    refused (a client could not tell them apart)."""
    names = [store_name(loc) for loc in locations]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise StoreError(f"two stores share the name {clash[0]!r} (the basename clients ask for): rename one")
    stores: dict[str, MiloStore] = {}
    try:
        for name, location in zip(names, locations):
            stores[name] = MiloStore.open(location, **options)
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


class DrainingServer(uvicorn.Server):
    """On SIGTERM or SIGINT: stop accepting (``on_exit``, then uvicorn closes its sockets), let in-flight
    requests finish within the graceful-shutdown timeout, and return normally, so the process exits 0
    (uvicorn's own handler would re-raise the signal once it has shut down). A second SIGINT forces.
    An engine loop that cannot go on ends the server too, with ``exit_code`` 1."""

    def __init__(self, app, config: uvicorn.Config):
        super().__init__(config)
        self.engine_loop = app.state.engine_loop
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.stop_accepting()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.engine_loop.failure is not None and not self.exit_code:  # it answered everything it held
            log.error("exiting with status 1, so that a supervisor restarts the server: the engine loop failed (%s)",
                      self.engine_loop.failure)
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)


def serve(app, *, host: str, port: int, drain_s: float) -> int:
    """Run ``app`` (from `create_app`) until a signal, then drain for at most ``drain_s`` seconds; the exit
    status: 0, or 1 when the engine loop failed."""
    server = DrainingServer(app, uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_s,
                                                log_level="info"))
    server.run()
    return server.exit_code
