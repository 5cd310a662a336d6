"""Staged blocks: whole files only, checksummed, verified before a resumed build reuses them."""
import pytest
import torch
from safetensors.torch import save_file

from milo_store.codecs.lowrank import factorize_block
from milo_store.staging import Staging, StagingError


def staged_block(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    return factorize_block(keys, values)


def test_a_staged_block_round_trips_and_verifies(tmp_path):
    staging = Staging(tmp_path / "s", {"run": 1})
    staging.put(3, staged_block(0))
    assert staging.staged() == [3] and staging.verify(3) and not staging.verify(4)
    got, want = staging.get(3), staged_block(0)
    assert all(torch.equal(getattr(got, k), getattr(want, k)) for k in "ASB")


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
def test_a_damaged_staged_block_fails_verification(tmp_path, damage):
    staging = Staging(tmp_path / "s", {"run": 1})
    staging.put(0, staged_block(0))
    f = tmp_path / "s" / "block_000000.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0x10  # inside B's last values: the header still parses
    else:
        data = data[:len(data) // 2]
    f.write_bytes(bytes(data))
    assert not staging.verify(0)
    staging.discard(0)
    assert staging.staged() == []


def test_a_block_staged_before_checksums_verifies_when_whole(tmp_path):
    staging = Staging(tmp_path / "s", {"run": 1})
    f = staged_block(1)
    save_file({"A": f.A, "S": f.S, "B": f.B}, str(tmp_path / "s" / "block_000002.safetensors"))
    assert staging.verify(2)


def test_reopening_drops_partial_writes_and_joining_needs_the_same_fingerprint(tmp_path):
    staging = Staging(tmp_path / "s", {"run": 1})
    staging.put(0, staged_block(0))
    (tmp_path / "s" / ".block_000001.tmp").write_bytes(b"half a file")
    Staging(tmp_path / "s", {"run": 1})
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["block_000000.safetensors", "fingerprint.json"]
    assert Staging(tmp_path / "s", {"run": 1}, join=True).staged() == [0]
    with pytest.raises(StagingError, match="does not hold this build's fingerprint"):
        Staging(tmp_path / "s", {"run": 2}, join=True)
    with pytest.raises(StagingError, match="no fingerprint"):
        Staging(tmp_path / "absent", {"run": 1}, join=True)
    Staging(tmp_path / "s", {"run": 2})  # another build's arguments: starts over
    assert Staging(tmp_path / "s", {"run": 2}, join=True).staged() == []
