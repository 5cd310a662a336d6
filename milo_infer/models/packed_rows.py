"""Several rows' tokens through one linear layer at once (issue 72): what `delta_rule`, `ssd` and `short_conv`'s
``layer_steps`` share. The engine packs every row's tokens end to end; a linear layer's projections are per token and
run over them all in one call, but its convolution and recurrence must see each row's own tokens alone, after that
row's own conv window and from its own state.

`convolve` runs the convolution of every row at once: the rows laid end to end, each after its window, each token's
output read from its own row's inputs alone. `scan` runs the recurrence: the rows fed one token (decoding) in one step of
their stacked states ([R, H, dk, dv] for a GDN layer), each row fed more (a prefill chunk) alone through its rule's
chunk form. Padding those to one length and stacking them measured slower on the CPU (2x with chunks of 20–30 tokens,
5x beside a long one; docs/benchmarks.md, issue 72), as did the chunk form over rows of one token stacked.
"""
from __future__ import annotations

import torch


def convolve(conv: torch.nn.Conv1d, inputs: torch.Tensor, windows, lengths) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The causal depthwise ``conv`` over each row's tokens of ``inputs`` [T, C] (rows of ``lengths`` tokens, end to
    end) after that row's ``windows`` [kernel − 1, C] (what it convolved before them): (the convolution's outputs
    [T, C], before any activation; each row's window after its tokens, its own tensor). A token's output is its
    kernel's taps times the inputs it reads, Σ_j w_j x_{t−kernel+1+j} + b, as transformers' own decode step sums them:
    conv1d over the laid rows measured 2–6x slower on the CPU (its depthwise path, 6,144 channels)."""
    width = conv.kernel_size[0] - 1
    laid, first, after, start, at = [], [], [], 0, 0
    for window, n in zip(windows, lengths):
        laid += [window.to(inputs.dtype), inputs[start:start + n]]
        first.append(torch.arange(at, at + n))
        after.append((at + n, at + n + width))
        start, at = start + n, at + n + width
    if start != inputs.shape[0]:
        raise ValueError(f"rows of {start} tokens in all for {inputs.shape[0]} packed tokens")
    laid, first, taps = torch.cat(laid), torch.cat(first).to(inputs.device), conv.weight[:, 0, :]
    mixed = laid[first] * taps[:, 0]  # each token's first input: `first`, its last `first` + width
    for j in range(1, width + 1):
        mixed.addcmul_(laid[first + j], taps[:, j])
    if conv.bias is not None:
        mixed += conv.bias
    return mixed, [laid[a:b].clone() for a, b in after]


def scan(step, run, states, lengths, tokens: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each row's recurrence over its tokens of ``tokens`` (per-token inputs [T, ...], rows end to end) from its
    ``states``: the rows of one token in one ``step`` (stacked states [R, ...] and their tokens [R, ...] to (states,
    outputs [R, ...])), every other row alone through ``run`` (a state and its tokens [n, ...] to (state, outputs
    [n, ...])). Returns (the outputs [T, ...], each row's state after)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    single = [r for r, n in enumerate(lengths) if n == 1]
    after, outputs = [None] * len(lengths), [None] * len(lengths)
    if single:
        fed = tokens if len(single) == tokens[0].shape[0] else \
            [x[torch.tensor([starts[r] for r in single], device=x.device)] for x in tokens]
        stepped, out = step(stacked([states[r] for r in single]), *fed)
        if len(single) == len(lengths):  # every row decoding
            return out, list(stepped)
        for j, r in enumerate(single):
            after[r], outputs[r] = stepped[j], out[j:j + 1]
    for r, n in enumerate(lengths):
        if n != 1:
            after[r], outputs[r] = run(states[r], *(x[starts[r]:starts[r + 1]] for x in tokens))
    return torch.cat(outputs), after


def stacked(states: list[torch.Tensor]) -> torch.Tensor:
    """``states`` as one tensor [R, ...]: a copy, or none where they lie end to end in one storage already (the rows a
    step before stepped in the same order: their states are its result's rows)."""
    first = states[0]
    if first.is_contiguous() and all(
            s.shape == first.shape and s.is_contiguous() and s.untyped_storage().data_ptr() ==
            first.untyped_storage().data_ptr() and s.storage_offset() == first.storage_offset() + i * first.numel()
            for i, s in enumerate(states)):
        return first.as_strided((len(states), *first.shape), (first.numel(), *first.stride()), first.storage_offset())
    return torch.stack(states)
