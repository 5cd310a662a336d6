"""Summarise a store: model, blocks, tokens, planned vs actual ratio, bytes, ranks and raw units per layer (and a
bits store's mean code widths)."""
from ..commandline import print_json
from ..report import describe, human_bytes
from ..store import MiloStore


def add_arguments(p):
    p.add_argument("path", help="store directory or URL (s3://bucket/prefix, gs://, az://, file://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    with MiloStore.open(args.path, tier="disk", verify=False) as store:
        info = describe(store)
    if args.json:
        print_json(info)
        return 0
    b, model = info["bytes"], info["model"] or {}
    lay = info["layout"]
    print(f"store        {info['path']}  (format v{info['format_version']})")
    print(f"model        {model.get('name', '?')}  layers={lay['num_layers']} kv_heads={lay['num_kv_heads']} "
          f"head_dim={lay['head_dim']}")
    alloc = info["allocation"] or {}
    print(f"codec        {info['codec']}  {info['factor_dtype']}  policy={alloc.get('policy')} scope={alloc.get('scope')} "
          f"kv_split={alloc.get('kv_split')}")
    print(f"content      {info['blocks']} blocks, {info['demonstrations']} demonstrations, {info['tokens']} tokens")
    planned = info["planned_ratio"]
    print(f"ratio        planned {planned if planned is None else f'{planned:.4f}'}  actual {info['actual_ratio']:.4f} "
          f"(factors{' + states' if b['states'] else ''} + index over fp16 full KV)")
    states = f"linear states {human_bytes(b['states'])}  " if b["states"] else ""
    print(f"bytes        full KV {human_bytes(b['full_fp16_kv'])}  factors {human_bytes(b['factors'])}  {states}"
          f"index {human_bytes(b['index'])}  on disk {human_bytes(b['on_disk'])} (all files)")
    chunks = info["chunks"]
    print(f"chunks       {chunks['factor']} of blocks ({human_bytes(b['factor_files'])}), {chunks['text']} text segment(s); "
          f"dead bytes {human_bytes(b['dead'])} ({b['dead'] / b['factor_files'] if b['factor_files'] else 0:.1%} of the "
          "block chunks: `milo-store gc` compacts them)")
    if len(info["layer_groups"]) > 1:  # layers that differ in what they hold (format 5)
        print("layer groups (what each holds; full: K and V of every layer in fp16, shared and K = V layers too; "
              "a linear layer's state, none):")
        for g in info["layer_groups"]:
            layers = g["layers"]
            print(f"  {g['group']:<12} {len(layers):>3} layers ({_runs(layers)})  stored {human_bytes(g['factor_bytes'])}"
                  f"  full {human_bytes(g['full_fp16_bytes'])}")
    ranks, raw = info["mean_rank_per_layer"], info["raw_share_per_layer"]
    any_raw = any(x for kind in raw.values() for x in kind)
    print("mean rank per layer (K / V)" + (", of factored units; share of raw units (K / V):" if any_raw else ":"))
    for l in range(lay["num_layers"]):
        k, v = (_rank(ranks[kind][l], raw[kind][l]) for kind in ("key", "value"))
        print(f"  layer {l:>3}  {k} / {v}" + (f"   raw {_share(raw['key'][l])} / {_share(raw['value'][l])}"
                                             if any_raw else ""))
    if widths := info.get("mean_stored_width_per_layer"):
        print("mean code width of the stored components per layer (K / V), bits:")
        for l in range(lay["num_layers"]):
            print(f"  layer {l:>3}  {widths['key'][l]:7.2f} / {widths['value'][l]:7.2f}")
    return 0


def _rank(mean, raw_share) -> str:
    """A layer's mean rank of one kind: 'all raw', or 'none' where the layer stores no such unit."""
    return f"{'none' if raw_share is None else 'all raw':>7}" if mean is None else f"{mean:7.2f}"


def _share(share) -> str:
    return f"{'-':>6}" if share is None else f"{share:6.1%}"


def _runs(layers: list[int]) -> str:
    """Layer numbers as runs: '0-4, 6-10'."""
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)
