"""The session the throughput benchmark times: `MiloSession` whose identity store can be copied into the
cache instead of rebuilt (the full-KV offload baseline).

Stage times come from the engine (CUDA events on CUDA); `STAGES` names them as reports show them.
"""
import torch

from milo_kernels.cpu import rope

from ..runtime.session import MiloSession

STAGES = ("retrieve", "read", "transfer", "rebuild", "model")


class TimedSession(MiloSession):
    """`MiloSession` for the benchmark: ``copy_identity`` replaces the rebuild of an identity store by a
    copy (the full-KV baseline), composed into the engine as its ``rebuild``."""

    def __init__(self, loaded, store, *, copy_identity: bool = False, **kwargs):
        if copy_identity and store.meta.get("codec") != "identity":
            raise ValueError(f"{store.path}: copy_identity needs an identity-codec store")
        super().__init__(loaded, store, **({"rebuild": copy_identity_layer} if copy_identity else {}), **kwargs)


def copy_identity_layer(factors, segments, out_k, out_v, cos, sin, *, interleaved=False, **_) -> None:
    """The full-KV baseline's fill: an identity segment's A is X itself, so per kind gather every segment's
    rows in one cat, rotate the keys, and scatter all rows to their (head, row) in one indexed write: a
    handful of launches a layer, as a real offload's copy would be."""
    d = out_k.shape[-1]
    segs = segments.cpu()
    for kind, out in ((0, out_k), (1, out_v)):
        mine = segs[segs[:, 5] == kind]
        if not len(mine):
            continue
        src, _, tokens, dst, head, _ = mine.unbind(1)
        x = torch.cat([factors[s:s + t * d].view(t, d) for s, t in zip(src.tolist(), tokens.tolist())])
        within = torch.arange(int(tokens.sum())) - torch.repeat_interleave(torch.cumsum(tokens, 0) - tokens, tokens)
        where = torch.stack([torch.repeat_interleave(dst, tokens) + within, torch.repeat_interleave(head, tokens)])
        if out.is_cuda:  # a pageable upload would wait for the compute stream, every layer
            where = where.pin_memory().to(out.device, non_blocking=True)
        rows, heads = where
        if kind == 0:
            x = rope(x.float(), cos[rows], sin[rows], interleaved)
        out[heads, rows] = x.to(out.dtype)
