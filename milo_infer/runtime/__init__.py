"""The query path at run time: plan a request on the host, rebuild its prefix from a store into a batched
cache, decode; the engine every front end (the CLI, the server, evaluation) drives."""
