"""All rows of a packed forward through a linear layer at once (`layer_steps` of `delta_rule`, `ssd`, `short_conv`,
over `milo_infer.models.packed_rows`; issue 72) equal each row alone (`layer_step`), on the tiny random hybrids of
`tests.infer.families`."""
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from milo_infer.models import FAMILIES
from milo_infer.models.capture import attention_modules, linear_rule
from milo_infer.models.families import layer_specs

from tests.infer import families

HYBRIDS = [family for family in families.TINY if FAMILIES[family].linear]  # the conformance suite's hybrids


@functools.cache
def linear_layers(family: str) -> tuple[int, list]:
    """The family's tiny model's hidden size and linear layers: (module, its rule)."""
    model = families.tiny_model(family).model
    return model.config.hidden_size, [(module, linear_rule(spec)) for module, spec in
                                      zip(attention_modules(model), layer_specs(model.config)) if spec.state_values]


def random_start(module, rule, gen: torch.Generator):
    """A state and conv window as a row's composed prefix leaves them (any values: the rules are exact from any)."""
    return tuple(torch.randn(x.shape, generator=gen) for x in rule.zero_state(module))


@pytest.mark.parametrize("family", HYBRIDS)
@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.sampled_from([1, 1, 2, 7, 65, 130]), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_rows_through_a_linear_layer_at_once_equal_each_row_alone(family, lengths, seed):
    """`layer_steps` over rows of mixed lengths packed end to end (decoding rows of one token, prefill chunks within
    and past a chunk of the recurrence) gives each row's output, state and conv window as `layer_step` over the row
    alone, then again a step later: every row one token from what the first left, beside a row joining with a fresh
    state and several tokens. A row reading another's tokens (its conv window, the recurrence) or another's state
    fails it."""
    gen = torch.Generator().manual_seed(seed)
    width, layers = linear_layers(family)
    for module, rule in layers:
        rows = [(*random_start(module, rule, gen), n) for n in lengths]
        for _ in range(2):
            hidden = torch.randn(sum(n for _, _, n in rows), width, generator=gen)
            out, after = rule.layer_steps(module, hidden, rows)
            start = 0
            for (state, window, n), (state_after, window_after) in zip(rows, after):
                alone = rule.layer_step(module, hidden[start:start + n], state, window)
                for got, want in zip((out[start:start + n], state_after, window_after), alone):
                    scale = want.abs().max().item() if want.numel() else 0.0  # LFM2's state: none
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * (scale + 1))
                start += n
            rows = [(state, window, 1) for state, window in after] + [(*random_start(module, rule, gen), 7)]
