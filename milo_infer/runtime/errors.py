"""How a request ends without an answer: refused before it runs (`RequestError`, a client error), or ended
while it ran (a `RowError`: only that row ends; the batch and its other rows go on)."""


class RequestError(ValueError):
    """A request no batch can serve as asked (its context exceeds the model's positions, an empty
    query, a budget below one token); the message names the problem."""


class RowError(RuntimeError):
    """A row ended without an answer; the batch and its other rows go on. The message names the cause."""


class BlockLoadError(RowError):
    """A block the row needs cannot be read (it fails its checksum, or a read failed after its retries)
    and the engine was told to fail such rows rather than recompute the block."""


class AdmissionOutOfMemory(RowError):
    """The device had no memory for this row's admission, even alone: a later try may fit."""


class RowFailed(RowError):
    """The row's own work (its decoder) raised; what it raised is chained."""


class UpstreamError(RowError):
    """The engine the server forwards to (a vLLM server) failed this request; the others go on."""
