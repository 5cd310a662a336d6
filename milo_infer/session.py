"""Answer queries from a mounted store: retrieve blocks, stream their factors, rebuild K/V, run the model.

Retrieval ranks *groups*, the blocks of m demonstrations the build encoded together; a store whose
blocks are finer (``block_group``: one store block per demonstration, the example-svd baseline)
puts each selected group's store blocks in order, so every store of one build gives a query the
same demonstrations in the same order. Without ``block_group`` a group is one block.

The context the model sees is [anchor][selected blocks][query]. Keys are stored before RoPE and
rotated at the positions the blocks take in this assembled, contiguous context; values are used as
stored. Everything the store holds for a query goes through ``milo_kernels.reconstruct_layer``.
"""
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

from milo_kernels import apply_rope, kernel_backend, plan_layers, reconstruct_layer
from milo_store import IncompatibleStoreError, MiloStore, full_kv_bytes
from milo_store.prefetch import LayerPrefetcher

from .cache import MiloCache
from .corpus import TaskSpec
from .decoding import LabelTrie, constrained_greedy, greedy_until
from .models import LoadedModel, rope_tables
from .retrieval import order_blocks, store_retriever
from .timing import StageClock

IDENTITY_FIELDS = ("config_hash", "num_layers", "num_kv_heads", "head_dim", "rope")
MAX_NEW_TOKENS = 64  # longest free-form answer by default (labels are bounded by their own trie)


@dataclass
class Answer:
    text: str
    blocks: list[int]  # store blocks, in context order
    groups: list[int]  # the retrieved groups they come from
    prefix_tokens: int
    kv_bytes_full: int
    kv_bytes_stored: int
    seconds: dict = field(default_factory=dict)


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU: where a query runs unless told otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place_model(loaded: LoadedModel, device) -> torch.device:
    """Move the model to ``device`` (default: `default_device`), in place; returns the device."""
    device = torch.device(device) if device is not None else default_device()
    loaded.model.to(device)
    return next(loaded.model.parameters()).device


def cache_keyword(model) -> str:
    """The name under which this model's forward takes a cache: transformers 5 renamed
    ``past_key_values`` to ``cache`` between 5.17 and 5.24, and passes an unknown name on silently."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_compatible(store: MiloStore, identity: dict) -> None:
    """Refuse a store whose K/V another model (shape, RoPE, config) produced."""
    stored = store.meta.get("model") or {}
    wrong = [f"{k}: store {stored.get(k)!r} vs model {identity.get(k)!r}" for k in IDENTITY_FIELDS
             if stored.get(k) != identity.get(k)]
    if wrong:
        raise IncompatibleStoreError(f"{store.path} was built for another model ({stored.get('name')}): " + "; ".join(wrong))


class MiloSession:
    """``MiloSession(loaded_model, store, k=6).answer("text")``; also ``answer_batch``."""

    def __init__(self, loaded: LoadedModel, store: MiloStore, *, k: int = 6, token_budget: int | None = None,
                 order: str = "score", device=None, max_new_tokens: int = MAX_NEW_TOKENS, prefetch_depth: int = 2,
                 aggregate: str = "max"):
        check_compatible(store, loaded.identity)
        self.model, self.tokenizer, self.store = loaded.model, loaded.tokenizer, store
        self.cache_kwarg = cache_keyword(self.model)
        model_device = next(self.model.parameters()).device
        self.device = torch.device(device) if device is not None else model_device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device != model_device:
            raise ValueError(f"the model is on {model_device} but the session was asked to run on {self.device}: "
                             f"move the model first (milo_infer.session.place_model)")
        self.dtype = next(self.model.parameters()).dtype
        self.k, self.token_budget, self.order = k, token_budget, order
        self.max_new_tokens, self.prefetch_depth = max_new_tokens, prefetch_depth
        self.task = TaskSpec(**{**store.meta["task"], "labels": tuple(store.meta["task"].get("labels", ()))})
        self.retriever = store_retriever(store, aggregate=aggregate)
        self.trie = LabelTrie(self.tokenizer, list(self.task.labels)) if self.task.answer_kind == "label" else None
        self.layout = store.layout
        self.rope_interleaved = store.meta["model"]["rope"]["layout"] == "interleaved"
        max_pos = store.meta["model"]["max_position_embeddings"]
        self.cos, self.sin = rope_tables(self.model, max_pos, device=self.device)
        anchor = store.anchor_kv()  # [L, 2, H, Ta, d], keys pre-RoPE
        if anchor is None:
            raise IncompatibleStoreError(f"{store.path} has no anchor K/V: not a store `milo build` wrote")
        Ta = anchor.shape[3]
        # the anchor always sits at positions 0..Ta-1: rotate it once, here
        keys = apply_rope(anchor[:, 0].float(), self.cos[:Ta].cpu(), self.sin[:Ta].cpu(), self.rope_interleaved)
        self.anchor_k = keys.to(self.device, self.dtype)
        self.anchor_v = anchor[:, 1].to(self.device, self.dtype)
        self.anchor_len = Ta

    # -- retrieval and assembly -----------------------------------------------------------------
    def select(self, text: str) -> list[int]:
        """The retrieved groups in context order (k and token_budget count groups and their tokens)."""
        ids = self.retriever.select(text, k=min(self.k, self.store.num_groups), token_budget=self.token_budget)
        return order_blocks(ids, self.retriever.scores(text), order=self.order)

    def rebuild(self, factors, segments, out_k, out_v, plan=None) -> None:
        """Write one layer's block rows of K (rotated) and V; the one call the query path makes."""
        reconstruct_layer(factors, segments, out_k, out_v, self.cos, self.sin, interleaved=self.rope_interleaved,
                          quant=self.layout.quant, plan=plan)

    def build_cache(self, block_ids: list[int], extra_tokens: int, clock: StageClock) -> MiloCache:
        """A cache whose layers fill [anchor][blocks] on first use. ``clock`` gains read (the store's
        reads), transfer (getting factors onto the device), wait (the compute stream waiting for a
        layer's factors) and reconstruct (dequantise and rebuild); for a store URL also remote (the part
        of this query's read spent on range GETs, from its own ``ReadStats``).

        Every layer's segment table (and, for the Triton kernel, its plan: validated, tiled, uploaded in
        one copy) is made here, on the host, once per query: ``fill`` only waits for its layer's factors
        and launches, so nothing in the forward waits for the host.
        """
        with clock.host("read"):
            prefetch = LayerPrefetcher(self.store, block_ids, self.device, depth=self.prefetch_depth)
        if self.store.remote:  # this query's own block cache misses of a store URL
            clock.defer("remote", lambda: prefetch.read_stats.remote_seconds)
        clock.defer("transfer", prefetch.transfer_seconds)
        tokens = self.store.block_tokens[block_ids]
        dst = self.anchor_len + np.concatenate(([0], np.cumsum(tokens)[:-1])).astype(np.int64)
        prefix = self.anchor_len + int(tokens.sum())
        if prefix + extra_tokens > self.cos.shape[0]:
            raise ValueError(f"the assembled context ({prefix} tokens of anchor and blocks + {extra_tokens} for the "
                             f"query and answer) exceeds the model's {self.cos.shape[0]} positions; lower k or set a "
                             f"token budget")
        segments = torch.from_numpy(np.stack([
            self.layout.layer_segments(self.store.ranks[block_ids, l], tokens, dst, prefetch.starts[l])
            for l in range(self.layout.num_layers)]))
        plans = (plan_layers(segments, self.layout.head_dim, factor_dtype=self.store.torch_dtype, device=self.device,
                             quant=self.layout.quant) if kernel_backend(self.device) == "triton" else None)

        def fill(layer: int, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
            with clock.device_stage("wait"):
                factors, _ = prefetch.layer(layer)
            with clock.device_stage("reconstruct"):
                out_k[:, :self.anchor_len] = self.anchor_k[layer]
                out_v[:, :self.anchor_len] = self.anchor_v[layer]
                self.rebuild(factors, segments[layer], out_k, out_v, None if plans is None else plans[layer])

        self.prefetch_bytes = int(prefetch.layer_values.sum()) * self.store.itemsize
        return MiloCache(self.layout.num_layers, prefix, prefix + extra_tokens,
                         (self.layout.num_kv_heads, self.layout.head_dim), self.dtype, self.device, fill)

    def model_step(self, ids: list[int], cache: MiloCache) -> torch.Tensor:
        """One model call over ``ids`` with the cache; the first call must fill every layer's prefix."""
        first = not cache.layers[0].is_initialized
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, **{self.cache_kwarg: cache})
        if first and not all(layer.is_initialized for layer in cache.layers):
            raise RuntimeError(f"the model did not use the milo cache (transformers {transformers.__version__} "
                               f"ignored {self.cache_kwarg}=): the answer would have no retrieved context")
        return out.logits[0]

    # -- answering ------------------------------------------------------------------------------
    def query_ids(self, text: str) -> list[int]:
        return self.tokenizer(self.task.render_query(text), add_special_tokens=False).input_ids

    @torch.inference_mode()
    def logits(self, text: str, block_ids: list[int] | None = None) -> torch.Tensor:
        """Logits [T_query, vocab] of the query in the assembled context of these store blocks (default:
        the retrieved groups' blocks), for exactness checks."""
        ids = self.query_ids(text)
        block_ids = self.store.blocks_of(self.select(text)) if block_ids is None else block_ids
        cache = self.build_cache(block_ids, len(ids), StageClock(self.device))
        return self.model_step(ids, cache).float()

    @torch.inference_mode()
    def answer(self, text: str) -> Answer:
        """The answer and its stage seconds: retrieve, read, transfer, wait, reconstruct, model (the
        forwards without wait and reconstruct). On CUDA, transfer runs on a side stream, overlapped."""
        clock = StageClock(self.device)
        with clock.host("retrieve"):
            groups = self.select(text)
            block_ids = self.store.blocks_of(groups)
        ids = self.query_ids(text)
        budget = self.trie.max_tokens if self.trie is not None else self.max_new_tokens
        cache = self.build_cache(block_ids, len(ids) + budget + 1, clock)

        def step(token):
            return self.model_step(ids if token is None else [token], cache)[-1].float()

        with clock.device_stage("forwards"):
            if self.trie is not None:
                decoded = constrained_greedy(step, self.trie)
            else:
                decoded = greedy_until(step, self.tokenizer, ["\n\n", "\nInput:", "\nQuery:"], self.max_new_tokens)
        seconds = clock.read()
        seconds["model"] = max(0.0, seconds.pop("forwards") - seconds.get("wait", 0.0) - seconds.get("reconstruct", 0.0))
        full = full_kv_bytes(self.layout, self.store.block_tokens[block_ids])
        return Answer(text=decoded.text.strip(), blocks=block_ids, groups=groups, prefix_tokens=cache.layers[0].prefix_len,
                      kv_bytes_full=full, kv_bytes_stored=self.prefetch_bytes, seconds=seconds)

    def answer_batch(self, texts: list[str]) -> list[Answer]:
        """Each query retrieves its own blocks, so each gets its own assembled context."""
        return [self.answer(t) for t in texts]
