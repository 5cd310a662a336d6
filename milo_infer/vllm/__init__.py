"""milo with vLLM: vLLM serves the requests, its prefix K/V loaded from a milo store.

`transfer` turns a query into the vLLM request that uses a store (its prompt is exactly the token ids
the store encoded, [anchor][retrieved blocks], then the query's; its ``kv_transfer_params`` name the
store and blocks) and checks such a request on the connector's side. `connector.MiloConnector` is the
KV connector vLLM loads from ``--kv-transfer-config``; only that module imports vLLM.
"""
