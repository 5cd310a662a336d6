"""Errors a store raises: each names the path and what is wrong with it."""


class StoreError(Exception):
    """Base class for everything that is wrong with a store or its use."""


class NotAStoreError(StoreError):
    """The path does not hold a committed milo store."""


class FormatVersionError(StoreError):
    """The store was written by a format version this reader does not understand."""


class StoreCorruptedError(StoreError):
    """The store's bytes or structure do not match what its metadata promises."""


class StoreLockedError(StoreError):
    """Another writer holds the store's lock."""


class LostRaceError(StoreError):
    """Another writer changed the store first (a store URL's manifest): this writer's version was not published."""


class IncompatibleStoreError(StoreError):
    """The store was built for another model than the one it is mounted for."""


class NotACacheError(StoreError):
    """A directory given as a block cache does not carry the cache's marker."""
