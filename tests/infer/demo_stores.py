"""Stores of the shipped demo corpus built from one encoding, for tests that run them through the model, and
a damaged copy of a store."""
import shutil

import torch

from milo_infer.building.config import BuildConfig
from milo_infer.tasks.corpus import load_corpus, task_from_corpus
from milo_infer.building.shared_staging import encode_once
from milo_store.synthetic import block_location
from milo_store import MiloStore

DEMO = "milo_infer/tasks/data/demo_corpus.jsonl"


def encoded_demo_stores(tmp_path_factory, loaded, configs: dict):
    """Stores of the first 8 demonstrations of the shipped corpus in blocks of 4, one per ``configs``
    entry (name: CompressionConfig), all from one encoding on one torch thread. A generator for module
    fixtures: yields ({name: mounted store}, {name: build summary}), then closes the stores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    corpus = load_corpus(DEMO)[:8]
    root = tmp_path_factory.mktemp("stores")
    summaries = encode_once(loaded, corpus, task_from_corpus(corpus), BuildConfig(block_size=4, context_blocks=1,
                            order="corpus"), configs, root, progress=False)
    opened = {name: MiloStore.open(root / name) for name in configs}
    yield opened, summaries
    for store in opened.values():
        store.close()
    torch.set_num_threads(before)


def corrupted_block(store_dir, dest, span: int = 4096) -> int:
    """A copy of the store whose factors hold ``span`` bytes of NaNs in the middle (all-ones bytes: NaN in fp16
    and fp32, so K/V that, if ever loaded, make attention NaN); the block whose checksum that breaks."""
    shutil.copytree(store_dir, dest)
    with MiloStore.open(dest, tier="disk") as store:
        middle = store.num_blocks // 2
        size = int(store.block_bytes([middle])[0])
    chunk, at = block_location(dest, middle)
    raw = bytearray(chunk.read_bytes())
    start = (at + size // 2 - span // 2) // 2 * 2
    raw[start:start + span] = b"\xff" * span
    chunk.write_bytes(bytes(raw))
    with MiloStore.open(dest, tier="disk") as store:
        bad = []
        for b in range(store.num_blocks):
            try:
                store.block(b)
            except Exception:  # noqa: BLE001 - any refusal to read is what we look for
                bad.append(b)
    assert len(bad) == 1, f"expected one corrupted block, found {bad}"
    return bad[0]
