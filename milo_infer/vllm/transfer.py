"""What a vLLM request carries to the milo connector, how a client builds it, and how the connector checks it.

The request names a store and its blocks in ``kv_transfer_params["milo"]``; its prompt token ids must
begin with the ids that store encoded its anchor and those blocks from. The connector never trusts the
names: it compares the ids (`PrefixClaims.claim`), and a request that does not match is served by vLLM
as a plain request (its whole prompt prefilled). `LoadSchedule` is the connector's scheduler-side
bookkeeping (which claimed requests the next step loads, into which cache slots), free of vLLM so that
preemption and resumption are tested without a vLLM process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from milo_store import MiloStore

from ..runtime.planning import EngineSettings, Request, StoreQueries, check_context
from ..runtime.prefix import prefix_token_ids

log = logging.getLogger("vllm.milo_infer.vllm.connector")  # vLLM configures handlers for its own namespace only

KEY = "milo"  # this connector's entry in a request's kv_transfer_params


def transfer_params(store: str, blocks: list[int], version: str | None = None) -> dict:
    """A request's entry for the connector; ``version``: the store version the blocks were chosen from, which
    the connector must hold to load them (it serves the request without the store otherwise)."""
    entry = {"store": store, "blocks": [int(b) for b in blocks]}
    return {KEY: entry if version is None else {**entry, "version": version}}


@dataclass(frozen=True)
class VllmPrompt:
    prompt_token_ids: list[int]  # [anchor][blocks][query]: what vLLM is sent as the prompt
    kv_transfer_params: dict
    groups: list[int]  # the retrieved groups, in context order
    blocks: list[int]  # their store blocks
    prefix_tokens: int  # anchor + blocks: what the connector can load
    labels: tuple[str, ...]  # the task's labels (empty for free-form answers)

    def body(self, model: str, *, max_tokens: int = 16, use_store: bool = True, logprobs: int | None = None) -> dict:
        """The OpenAI completions request for vLLM: greedy, constrained to the task's labels where it has
        them (vLLM's structured outputs, as milo's engine constrains to its label trie); without
        ``use_store`` the same prompt is plain vLLM, every token prefilled (the true-prefill reference)."""
        body = {"model": model, "prompt": self.prompt_token_ids, "max_tokens": max_tokens, "temperature": 0}
        if self.labels:
            body["structured_outputs"] = {"choice": [" " + label for label in self.labels]}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if use_store:
            body["kv_transfer_params"] = self.kv_transfer_params
        return body


class VllmPrompts:
    """Turns queries into vLLM requests over one mounted store: retrieval, rendering and the context's
    length checks as milo's own engine does them (same groups, same order, same query ids), no model
    needed."""

    def __init__(self, name: str, store: MiloStore, tokenizer, settings: EngineSettings = EngineSettings()):
        self.name, self.store, self.settings = name, store, settings
        self.queries = StoreQueries(store, tokenizer, settings.aggregate)

    def prompt(self, request: Request, blocks: list[int] | None = None) -> VllmPrompt:
        """``blocks`` overrides retrieval (exactness checks place chosen blocks); raises `RequestError`
        where milo's engine would (the context past the model's positions, k below 1)."""
        groups, blocks = self.queries.choose(request, self.settings, blocks)
        query_ids = self.queries.query_ids(request)
        prompt = vllm_prompt(self.name, self.store, groups, blocks, query_ids, tuple(self.queries.task.labels))
        anchor = len(prefix_token_ids(self.store, []))
        check_context(anchor, prompt.prefix_tokens, len(query_ids),
                      self.queries.answer_budget(request, self.settings.max_new_tokens),
                      self.store.meta["model"]["max_position_embeddings"])
        return prompt


def vllm_prompt(name: str, store: MiloStore, groups: list[int], blocks: list[int], query_ids: list[int],
                labels: tuple[str, ...]) -> VllmPrompt:
    prefix = prefix_token_ids(store, blocks)
    if prefix is None:
        raise ValueError(f"{store.path} keeps no token ids for its anchor or blocks: vLLM requests need a store "
                         f"`milo build` wrote")
    return VllmPrompt(prompt_token_ids=prefix + list(query_ids), kv_transfer_params=transfer_params(name, blocks, store.version),
                      groups=list(groups), blocks=list(blocks), prefix_tokens=len(prefix), labels=labels)


@dataclass(frozen=True)
class Claim:
    store: str
    blocks: list[int]
    prefix_tokens: int  # anchor + blocks, as the prompt's first tokens
    version: str  # the store version the scheduler checked them against; a worker holding another loads nothing


class PrefixClaims:
    """The connector's check of a request: the prefix it may load, or None with the reason why not."""

    def __init__(self, stores: dict[str, MiloStore]):
        self.stores = stores

    def claim(self, params: dict | None, prompt_token_ids: list[int]) -> tuple[Claim | None, str]:
        entry = (params or {}).get(KEY)
        if entry is None:
            return None, "no milo entry in kv_transfer_params"
        if not isinstance(entry, dict) or not isinstance(entry.get("store"), str) or \
                not isinstance(entry.get("blocks"), list) or not all(isinstance(b, int) for b in entry["blocks"]) or \
                not isinstance(entry.get("version", ""), str):
            return None, (f"kv_transfer_params[{KEY!r}] must be {{'store': name, 'blocks': [block ids], 'version': "
                          f"version (optional)}}, got {entry!r}")
        name, blocks, version = entry["store"], entry["blocks"], entry.get("version")
        store = self.stores.get(name)
        if store is None:
            return None, f"no store named {name!r} is configured (configured: {', '.join(self.stores)})"
        if version is not None and version != store.version:
            return None, (f"the request's blocks are of version {version!r} of store {name!r}, this vLLM mounted version "
                          f"{store.version!r} at its start (restart it to serve the new version)")
        if any(not 0 <= b < store.num_blocks for b in blocks):
            return None, f"block ids outside store {name!r}'s 0..{store.num_blocks - 1}"
        ids = prefix_token_ids(store, blocks)
        if ids is None:
            return None, f"store {name!r} keeps no token ids for its anchor or blocks"
        if list(prompt_token_ids[:len(ids)]) != ids:
            return None, f"the prompt does not begin with the token ids store {name!r} encoded its anchor and blocks from"
        return Claim(name, list(blocks), len(ids), store.version), ""


def connector_config(stores: dict[str, str], *, load_failure: str = "recompute", **options) -> dict:
    """vLLM's ``--kv-transfer-config`` (as JSON) for the milo connector over ``stores`` (name: path or URL);
    ``options`` are the connector's extra keys (``tier``, ``memory_cache_bytes``, ``block_cache_dir``,
    ``block_cache_bytes``). ``load_failure``: what vLLM does with a request whose prefix cannot be read,
    ``"recompute"`` it or ``"fail"`` it."""
    return {"kv_connector": "MiloConnector", "kv_connector_module_path": "milo_infer.vllm.connector",
            "kv_role": "kv_consumer", "kv_load_failure_policy": load_failure,
            "kv_connector_extra_config": {"stores": {name: str(path) for name, path in stores.items()}, **options}}


NULL_BLOCK = 0  # vLLM's placeholder block id: a group holds no page there (a window layer's blocks its window left)


@dataclass
class Load:
    """One request's prefix tokens [start, end) to load into vLLM's cache slots, per KV cache group."""
    req_id: str
    claim: Claim  # the store and blocks, checked against the prompt
    start: int
    end: int
    slots: tuple[list[int], ...]  # per KV cache group, one per token in [start, end); -1 where that group holds
    # no page for it (vLLM's hybrid KV cache manager gives a window layer's group pages only for the blocks its
    # window still reaches: the others are its null block)
    block_ids: list[int]  # the vLLM blocks those slots are in, every group's (reported on a load error)


class LoadSchedule:
    """The scheduler side of the connector, one vLLM ``schedule()`` at a time: ``claim`` a request's prefix
    (vLLM asks before it allocates), ``allocated`` (vLLM gave the claimed tokens blocks, or not), then
    ``loads`` for the requests this step runs. A claim lives for the one schedule that made it: none is
    left pending for a later step, so a preempted request's old blocks are never loaded late, and a
    request that resumes is claimed anew and loaded into its new blocks."""

    def __init__(self, claims: PrefixClaims, block_size: int):
        self.claims, self.block_size = claims, block_size
        self._claimed: dict[str, tuple[Claim, int, int]] = {}  # req_id -> (claim, start, end) awaiting blocks
        self._to_load: set[str] = set()

    def claim(self, req_id: str, params: dict | None, prompt_token_ids: list[int],
              num_computed_tokens: int) -> tuple[int, str]:
        """Tokens the connector will load for this request, or 0 and why the store cannot serve it ('' where
        vLLM has computed the prefix already)."""
        claim, why = self.claims.claim(params, prompt_token_ids)
        if claim is None:
            return 0, why
        # the whole prefix, as milo's engine rebuilds it (vLLM takes a sub-block tail), but never the
        # prompt's last token: vLLM computes that one to sample from
        end = min(claim.prefix_tokens, len(prompt_token_ids) - 1)
        if end <= num_computed_tokens:
            return 0, ""
        self._claimed[req_id] = (claim, num_computed_tokens, end)
        return end - num_computed_tokens, ""

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        if num_external_tokens > 0 and req_id in self._claimed:
            self._to_load.add(req_id)
        else:
            self._claimed.pop(req_id, None)

    def loads(self, blocks_of: dict[str, tuple[list[int], ...]]) -> list[Load]:
        """The loads of this step, given per KV cache group the vLLM block ids of the requests it schedules new
        or resumed; every claim is settled."""
        loads = []
        for req_id in self._to_load:
            if req_id not in blocks_of:
                log.warning("request %s was claimed but not scheduled: its prefix is not loaded", req_id)
                continue
            claim, start, end = self._claimed[req_id]
            slots, used = [], []
            for blocks in blocks_of[req_id]:
                slots.append([-1 if blocks[p // self.block_size] == NULL_BLOCK else
                              blocks[p // self.block_size] * self.block_size + p % self.block_size
                              for p in range(start, end)])
                reached = blocks[start // self.block_size:(end - 1) // self.block_size + 1]
                used += [b for b in reached if b != NULL_BLOCK]
            loads.append(Load(req_id, claim, start, end, tuple(slots), used))
        self._claimed.clear()
        self._to_load.clear()
        return loads

    def finished(self, req_id: str) -> None:
        self._claimed.pop(req_id, None)
        self._to_load.discard(req_id)
