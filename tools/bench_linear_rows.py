"""A step's linear layers at a synthetic hybrid's shape, by the number of rows in it (issue 72's goal: a 16-row decode
step's linear layers cost at most 3x a 1-row step's).

Builds the shape's first linear layer (`synthetic_model.SHAPES`, random weights, fp32 on the CPU or bf16 on a GPU)
and times the engine's forward of it over a packed step (`linear_rows.rows_forward`: every row ``--tokens`` tokens,
from a random fp32 state and conv window of its own at first, then from what the step before kept), interleaved
rounds, medians; a step's linear layers are that
times the shape's count of them. ``--checkout DIR`` times another checkout's code (its `milo_infer`: the same call
before and after a change). Run:

    PYTHONPATH=$PWD .venv/bin/python tools/bench_linear_rows.py --rows 1,16 --threads 1
    PYTHONPATH=$PWD .venv/bin/python tools/bench_linear_rows.py --rows 1,16 --threads 1 --checkout /work/main
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.5-0.8b", help="a hybrid of milo_infer.bench.synthetic_model.SHAPES")
    p.add_argument("--rows", default="1,16", help="rows in a step, comma separated (the first is the baseline)")
    p.add_argument("--tokens", type=int, default=1, help="tokens each row feeds the step (1: decoding)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose milo_infer is timed")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.tokens < 1 or args.rounds < 1:
        p.error("--rows, --tokens and --rounds must be positive")
    if not (args.checkout / "milo_infer").is_dir():
        p.error(f"--checkout {args.checkout}: no milo_infer there")
    return args, rows


class Pack:
    """What `rows_forward` reads of an engine's pack: no joining rows, each row's `RowState` and span."""

    def __init__(self, linear):
        self.fills, self.linear = [], linear


def main(argv=None) -> None:
    args, row_counts = parse(argv)
    sys.path.insert(0, str(args.checkout.resolve()))
    import torch
    import transformers

    from milo_infer.bench.synthetic_model import CONFIG_CLASS, SHAPES
    from milo_infer.models.capture import attention_modules, linear_rule
    from milo_infer.models.families import layer_specs
    from milo_infer.runtime.linear_rows import RowState, rows_forward

    if args.shape not in SHAPES:
        sys.exit(f"--shape {args.shape}: not one of {', '.join(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_class = getattr(transformers, CONFIG_CLASS.get(args.shape, "Qwen2Config"))
    full = config_class(**SHAPES[args.shape], tie_word_embeddings=False)
    linear = [l for l, spec in enumerate(layer_specs(full)) if spec.state_values]
    if not linear:
        sys.exit(f"--shape {args.shape} has no linear layers")
    small = config_class(**{**SHAPES[args.shape], "num_hidden_layers": linear[0] + 1}, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(small, dtype=dtype).eval().requires_grad_(False)
    layer = linear[0]
    module, spec = attention_modules(model)[layer], layer_specs(small)[layer]
    rule = linear_rule(spec)

    def step_of(rows: int):
        states = []
        for _ in range(rows):
            state = RowState()
            state.layers[layer] = tuple(torch.randn_like(x) for x in rule.zero_state(module, device))
            states.append(state)
        n = args.tokens
        pack = Pack([(s, r * n, (r + 1) * n) for r, s in enumerate(states)])
        hidden = torch.randn(1, rows * n, small.hidden_size, device=device, dtype=dtype)

        def step():  # as the engine's steps follow each other: each from the states the last one kept
            rows_forward(module, layer, rule, hidden, pack)
            for state in states:
                state.commit()
        return step

    def timed(fn) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    steps = {rows: step_of(rows) for rows in row_counts}
    for fn in steps.values():  # warm-up
        timed(fn)
    seconds = {rows: [] for rows in row_counts}
    for _ in range(args.rounds):
        for rows, fn in steps.items():
            seconds[rows].append(timed(fn))
    base = statistics.median(seconds[row_counts[0]])
    results = []
    print(f"{args.shape}: {len(linear)} linear layers ({spec.rule}), {args.tokens} token(s) a row, "
          f"checkout {args.checkout}, {torch.get_num_threads()} torch thread(s), {device}")
    print("rows | ms a linear layer | ms a step's linear layers | vs %d row(s)" % row_counts[0])
    for rows in row_counts:
        ms = statistics.median(seconds[rows]) * 1e3
        results.append({"rows": rows, "tokens": args.tokens, "layer_ms": ms, "step_ms": ms * len(linear),
                        "vs_first": ms / (base * 1e3)})
        print(f"{rows} | {ms:.2f} | {ms * len(linear):.1f} | {ms / (base * 1e3):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "linear_layers": len(linear), "rule": spec.rule,
                                         "checkout": str(args.checkout), "threads": torch.get_num_threads(),
                                         "device": str(device), "results": results}, indent=1))


if __name__ == "__main__":
    main()
