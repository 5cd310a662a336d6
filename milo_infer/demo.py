"""The main job on embedded defaults: build a store from the shipped demo corpus with the default
model (once), then answer the shipped demo queries from it and show what each answer cost.

Run: ``make demo`` (or ``python -m milo_infer.demo [--store PATH] [--ratio 0.5] [--rebuild]``).
"""
import argparse
import json
import os
import time
from importlib import resources
from pathlib import Path

from milo_store import MiloStore, NotAStoreError
from milo_store.report import describe

from .build import BuildConfig, build_store, default_compression
from .corpus import load_corpus, task_from_corpus
from .models import load_model
from .scoring import is_correct
from .session import MiloSession

DATA = resources.files("milo_infer") / "data"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=os.environ.get("MILO_DEMO_STORE", "stores/demo"))
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rebuild", action="store_true", help="build again even if the store exists")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    loaded = load_model("default")
    print(f"model: {loaded.identity['name']} ({loaded.identity['num_layers']} layers, "
          f"{loaded.identity['num_kv_heads']} KV heads, head dim {loaded.identity['head_dim']}), "
          f"loaded in {time.perf_counter() - t:.1f} s")
    store_path = Path(args.store)
    try:
        if args.rebuild:
            raise NotAStoreError("rebuild requested")
        MiloStore.open(store_path, tier="disk").close()
        print(f"store: reusing {store_path}")
    except NotAStoreError:
        demos = load_corpus(DATA / "demo_corpus.jsonl")
        config = BuildConfig(block_size=32, context_blocks=2, compression=default_compression(args.ratio))
        print(f"store: building {store_path} from {len(demos)} demonstrations (ratio {args.ratio})")
        summary = build_store(store_path, loaded, demos, task_from_corpus(demos), config, force=True)
        print(f"  built in {summary['encode_s'] + summary['factorize_s'] + summary['write_s']:.0f} s: "
              f"{summary['blocks']} blocks, {summary['tokens']} tokens")
    store = MiloStore.open(store_path, tier="host")
    info = describe(store)
    b = info["bytes"]
    print(f"  {info['blocks']} blocks, {info['demonstrations']} demonstrations; KV full {b['full_fp16_kv'] / 2**20:.1f} MiB, "
          f"stored {b['accounted'] / 2**20:.1f} MiB (ratio {info['actual_ratio']:.3f}, planned {info['planned_ratio']})\n")
    session = MiloSession(loaded, store, k=args.k)
    queries = [json.loads(line) for line in (DATA / "demo_queries.jsonl").read_text().splitlines() if line.strip()]
    correct = 0
    for q in queries:
        a = session.answer(q["input"])
        ok = is_correct(a.text, q["output"], "label")
        correct += ok
        print(f"{'ok ' if ok else 'MISS'} {q['input']!r}\n     -> {a.text!r} (expected {q['output']!r})  blocks {a.blocks}  "
              f"KV {a.kv_bytes_stored / 2**20:.1f} of {a.kv_bytes_full / 2**20:.1f} MiB  "
              f"{sum(a.seconds.values()) * 1e3:.0f} ms")
    print(f"\n{correct}/{len(queries)} demo queries answered as expected")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
