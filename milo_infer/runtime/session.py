"""Answer queries from one mounted store: ``MiloSession(loaded, store, EngineSettings(k=6)).answer("text")``.

A thin face of the batched engine (``milo_infer.runtime.engine``) over a single store: the context the model
sees is [anchor][selected blocks][query], keys stored before RoPE and rotated at the positions the
blocks take in this assembled context, everything the store holds going through
``milo_kernels.reconstruct_layer``. ``answer_batch`` answers its queries as one batch. A session made
with ``prefill=True`` retrieves the same blocks and lets the model prefill their tokens instead (the
plain-prompting baseline); one whose settings have ``recompute=n`` has the model compute each retrieved block's
first n tokens again in the assembled context, after the rebuild (`Request.recompute`).
"""
from dataclasses import replace

import torch

from milo_store import MiloStore

from ..models import LoadedModel
from .engine import Engine
from .interface import Answer
from .planning import EngineSettings, Request
from .prefix import rebuild_layer


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU: where a query runs unless told otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place_model(loaded: LoadedModel, device) -> torch.device:
    """Move the model to ``device`` (default: `default_device`), in place; returns the device."""
    device = torch.device(device) if device is not None else default_device()
    loaded.model.to(device)
    return next(loaded.model.parameters()).device


class MiloSession:
    """One store, one engine; its ``k`` may be changed between calls. ``prefill``: the model prefills
    [anchor][retrieved blocks][query] from their token ids, reading no K/V; ``settings.recompute``: the
    first tokens of each retrieved block the model computes again over the rebuilt context. ``max_rows``,
    ``kv_cache_memory``, ``attention`` and ``shared_blocks`` are the engine's (`Engine`)."""

    def __init__(self, loaded: LoadedModel, store: MiloStore, settings: EngineSettings = EngineSettings(), *,
                 device=None, prefetch_depth: int = 2, rebuild=rebuild_layer, prefill: bool = False,
                 max_rows: int = 16, kv_cache_memory: int | float | None = None, attention: str = "auto",
                 shared_blocks: bool = True):
        self.store, self.prefill = store, prefill
        self.engine = Engine(loaded, {"store": store}, settings, device=device, prefetch_depth=prefetch_depth,
                             rebuild=rebuild, max_rows=max_rows, kv_cache_memory=kv_cache_memory, attention=attention,
                             shared_blocks=shared_blocks)
        self.mounted = self.engine.stores["store"]
        self.retriever = self.mounted.queries.retriever
        self.device, self.layout = self.engine.device, store.layout

    @property
    def k(self) -> int:
        return self.engine.settings.k

    @k.setter
    def k(self, value: int) -> None:
        self.engine.settings = replace(self.engine.settings, k=value)

    def plan(self, text: str, block_ids: list[int] | None = None):
        return self.engine.plan("store", Request(text, prefill=self.prefill), block_ids=block_ids)

    def select(self, text: str) -> list[int]:
        """The retrieved groups in context order."""
        return self.plan(text).groups

    def query_ids(self, text: str) -> list[int]:
        return self.mounted.queries.query_ids(Request(text))

    def logits(self, text: str, block_ids: list[int] | None = None) -> torch.Tensor:
        """Logits [T_query, vocab] of the query in the assembled context of these store blocks (default:
        the retrieved groups' blocks), for exactness checks."""
        return self.engine.logits([self.plan(text, block_ids)])[0]

    def answer(self, text: str) -> Answer:
        """The answer and its stage seconds: retrieve, read, transfer, wait, rebuild, model (the
        forwards without wait and rebuild). On CUDA, transfer runs on a side stream, overlapped."""
        return self.answer_batch([text])[0]

    def answer_batch(self, texts: list[str], stats: dict | None = None) -> list[Answer]:
        """Each query retrieves its own blocks; all of them run as one batch (shared blocks fetched once and held
        once); ``stats`` gains the batch's (`Engine.answer`)."""
        return self.engine.answer([self.plan(t) for t in texts], stats)
