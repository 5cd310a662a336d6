import pytest

from milo_store import CompressionConfig, Layout
from milo_store.synthetic import build_synthetic_store

LAYOUT = Layout(3, 2, 16)
TOKENS = [23, 40, 9, 31]


@pytest.fixture
def small_store(tmp_path):
    """A small committed store over synthetic blocks (fresh per test: corruption tests damage it)."""
    return build_synthetic_store(tmp_path / "store", LAYOUT, TOKENS, CompressionConfig(ratio=0.5), seed=1)

