"""`milo query`'s flags: each size names what it sizes (--memory-cache-size the cached tier's LRU only), and a
negative --recompute is refused before anything is opened."""
from milo_infer.cli.main import main as milo


def test_memory_cache_size_needs_the_cached_tier(tmp_path, capsys):
    assert milo(["query", str(tmp_path / "store"), "q", "--memory-cache-size", "1G"]) == 2
    err = capsys.readouterr().err
    assert "--memory-cache-size" in err and "--tier cached" in err and len(err.strip().splitlines()) == 1


def test_the_block_cache_keeps_its_old_flag(tmp_path, capsys):
    for flag in ("--block-cache-size", "--cache-size"):  # both reach the block cache; the store is then missing
        assert milo(["query", str(tmp_path / "store"), "q", flag, "10G", "--cache-dir", str(tmp_path / "c")]) == 2
        assert "no such store directory" in capsys.readouterr().err


def test_a_negative_recompute_is_one_line_before_the_store_opens(tmp_path, capsys):
    assert milo(["query", str(tmp_path / "store"), "q", "--recompute", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--recompute must be at least 0" in err and len(err.strip().splitlines()) == 1
