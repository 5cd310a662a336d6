import pytest
import torch

from milo_store import CompressionConfig, Layout, write_store
from milo_store.codecs.baselines import WeightedBlocks
from milo_store.synthetic import build_synthetic_store, staged_synthetic_blocks

LAYOUT = Layout(3, 2, 16)
TOKENS = [23, 40, 9, 31]


def synthetic_store(tmp_path):
    """A small committed low-rank store over synthetic blocks."""
    return build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CompressionConfig(ratio=0.5), seed=1)


@pytest.fixture
def small_store(tmp_path):
    """A small committed store over synthetic blocks (fresh per test: corruption tests damage it)."""
    return synthetic_store(tmp_path)


def staged(tmp_path, layout, tokens, seed=0):
    return staged_synthetic_blocks(tmp_path / f"staging-{seed}", layout, tokens, seed)


def channel_scale(layout, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(layout.num_layers, 2, layout.num_kv_heads, layout.head_dim, generator=g))


def bits_store(tmp_path, tokens=(23, 40, 9, 31), ratio=0.2, seed=0):
    """A bits store over synthetic blocks, its layout and its pass-two source (what the blocks encode)."""
    layout = Layout(2, 2, 16)
    staging, _ = staged(tmp_path, layout, list(tokens), seed)
    config = CompressionConfig(codec="bits", ratio=ratio, query_aware=True)
    path = write_store(tmp_path / "s", staging, len(tokens), layout, config, channel_scale=channel_scale(layout, seed),
                       anchor_kv=torch.randn(2, 2, 2, 3, 16), attrs={"model": {"name": "synthetic"}})
    return path, layout, WeightedBlocks(staging, len(tokens), channel_scale(layout, seed))
