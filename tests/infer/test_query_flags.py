"""`milo query`'s size flags each name what they size: --memory-cache-size the cached tier's LRU only."""
from milo_infer.cli.main import main as milo


def test_memory_cache_size_needs_the_cached_tier(tmp_path, capsys):
    assert milo(["query", str(tmp_path / "store"), "q", "--memory-cache-size", "1G"]) == 2
    err = capsys.readouterr().err
    assert "--memory-cache-size" in err and "--tier cached" in err and len(err.strip().splitlines()) == 1


def test_the_block_cache_keeps_its_old_flag(tmp_path, capsys):
    for flag in ("--block-cache-size", "--cache-size"):  # both reach the block cache; the store is then missing
        assert milo(["query", str(tmp_path / "store"), "q", flag, "10G", "--cache-dir", str(tmp_path / "c")]) == 2
        assert "no such store directory" in capsys.readouterr().err
