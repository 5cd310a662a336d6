"""Mount the stores a server is started with, and run its app under uvicorn with a graceful drain."""
import signal
from pathlib import PurePosixPath

import uvicorn

from milo_store import MiloStore
from milo_store.errors import StoreError


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
    (uvicorn's own handler would re-raise the signal once it has shut down). A second SIGINT forces."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def serve(app, *, host: str, port: int, drain_s: float) -> None:
    """Run ``app`` (from `create_app`) until a signal, then drain for at most ``drain_s`` seconds."""
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_s, log_level="info")
    DrainingServer(config, app.state.engine_loop.stop_accepting).run()
