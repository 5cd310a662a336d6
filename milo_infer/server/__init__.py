"""`milo serve`: an OpenAI-compatible HTTP server over mounted stores, batching concurrent requests.

`protocol` checks request bodies and shapes responses, `scheduler` runs the one engine loop that
owns the running batch, `metrics` is its Prometheus registry, `app` the FastAPI handlers, and
`launch` mounts the stores and runs uvicorn with a graceful drain.
"""

MAX_BODY_BYTES = 1 << 20  # a request body's default limit: a query, not a corpus
