"""Answer queries from one mounted store: ``MiloSession(loaded, store, k=6).answer("text")``.

A thin face of the batched engine (``milo_infer.runtime.engine``) over a single store: the context the model
sees is [anchor][selected blocks][query], keys stored before RoPE and rotated at the positions the
blocks take in this assembled context, everything the store holds going through
``milo_kernels.reconstruct_layer``. ``answer_batch`` answers its queries as one batch. A session made
with ``prefill=True`` retrieves the same blocks and lets the model prefill their tokens instead (the
plain-prompting baseline); one made with ``recompute=n`` has the model compute each retrieved block's
first n tokens again in the assembled context, after the rebuild (`Request.recompute`).
"""
import torch

from milo_store import MiloStore

from .engine import Answer, Engine, Request, rebuild_layer
from ..models import LoadedModel
from .planning import MAX_NEW_TOKENS, check_compatible

__all__ = ["Answer", "MAX_NEW_TOKENS", "MiloSession", "check_compatible", "default_device", "place_model"]


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU: where a query runs unless told otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def place_model(loaded: LoadedModel, device) -> torch.device:
    """Move the model to ``device`` (default: `default_device`), in place; returns the device."""
    device = torch.device(device) if device is not None else default_device()
    loaded.model.to(device)
    return next(loaded.model.parameters()).device


class MiloSession:
    """One store, one engine; ``k`` and ``token_budget`` may be changed between calls. ``prefill``: the
    model prefills [anchor][retrieved blocks][query] from their token ids, reading no K/V; ``recompute``: the
    first tokens of each retrieved block the model computes again over the rebuilt context."""

    def __init__(self, loaded: LoadedModel, store: MiloStore, *, k: int = 6, token_budget: int | None = None,
                 order: str = "score", device=None, max_new_tokens: int = MAX_NEW_TOKENS, prefetch_depth: int = 2,
                 aggregate: str = "max", rebuild=rebuild_layer, prefill: bool = False,
                 recompute: int = 0):
        self.store, self.prefill = store, prefill
        self.engine = Engine(loaded, {"store": store}, k=k, token_budget=token_budget, order=order, device=device,
                             max_new_tokens=max_new_tokens, prefetch_depth=prefetch_depth, aggregate=aggregate,
                             rebuild=rebuild, recompute=recompute)
        self.mounted = self.engine.stores["store"]
        self.retriever = self.mounted.retriever
        self.device, self.layout = self.engine.device, store.layout

    @property
    def k(self) -> int:
        return self.engine.k

    @k.setter
    def k(self, value: int) -> None:
        self.engine.k = value

    def plan(self, text: str, block_ids: list[int] | None = None):
        return self.engine.plan("store", Request(text, prefill=self.prefill), block_ids=block_ids)

    def select(self, text: str) -> list[int]:
        """The retrieved groups in context order."""
        return self.plan(text).groups

    def query_ids(self, text: str) -> list[int]:
        return self.mounted.query_ids(text)

    def logits(self, text: str, block_ids: list[int] | None = None) -> torch.Tensor:
        """Logits [T_query, vocab] of the query in the assembled context of these store blocks (default:
        the retrieved groups' blocks), for exactness checks."""
        return self.engine.logits([self.plan(text, block_ids)])[0]

    def answer(self, text: str) -> Answer:
        """The answer and its stage seconds: retrieve, read, transfer, wait, reconstruct, model (the
        forwards without wait and reconstruct). On CUDA, transfer runs on a side stream, overlapped."""
        return self.answer_batch([text])[0]

    def answer_batch(self, texts: list[str]) -> list[Answer]:
        """Each query retrieves its own blocks; all of them run as one batch (shared blocks fetched once)."""
        return self.engine.answer([self.plan(t) for t in texts])
