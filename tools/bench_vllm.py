"""vLLM with the milo connector against vLLM prefilling the same prompts itself: agreement, accuracy, TTFT, qps.

Runs in milo's venv and starts one vLLM server from vLLM's (``$MILO_VLLM_PYTHON``, default
``.venv-vllm/bin/python``: CPU or CUDA, its venv's build) with the connector over the given stores and
prefix caching off, so a request without ``kv_transfer_params`` is a true prefill of the very same
token ids. For each test query (the same retrieval for every store: they must come from one build):

* answers, label-constrained and greedy, from each store and from plain vLLM; accuracy, and the share
  of answers equal to plain vLLM's (and to milo's own engine's, where ``--milo-predictions`` gives
  `milo eval` prediction files of the same stores and queries);
* at concurrency 1 and ``--concurrency``: time to first token (a 1-token request's latency) and
  queries per second, with the store and without;
* what each vLLM worker loaded, read from the stores and spent rebuilding (the connector's counters on
  vLLM's /metrics), so runs at different ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` compare.

    .venv/bin/python tools/bench_vllm.py --dataset banking77 --n-queries 100 --k 6 \\
        --store full=DIR --store r0.5=DIR --store r0.25=DIR --out results.json
"""
import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from milo_infer.tasks.datasets import load_dataset  # noqa: E402
from milo_infer.runtime.planning import EngineSettings, Request  # noqa: E402
from milo_infer.models import model_directory  # noqa: E402
from milo_infer.tasks.scoring import is_correct  # noqa: E402
from milo_infer.vllm import launch  # noqa: E402
from milo_infer.vllm.transfer import VllmPrompts  # noqa: E402
from milo_store import MiloStore  # noqa: E402


def start(stores: dict[str, str], port: int, log: Path, vllm_args: list[str]) -> subprocess.Popen:
    names = {Path(p).name: n for n, p in stores.items()}
    if len(names) != len(stores):
        raise SystemExit("each store needs its own basename (the connector's name for it)")
    args = ["--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details", *vllm_args]
    python = os.environ.get("MILO_VLLM_PYTHON") or str(Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python")
    cmd = launch.launcher_command(list(stores.values()), python, vllm_args=tuple(args))  # the launcher's defaults
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)  # the caller's packages too
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 900
    while True:
        if process.poll() is not None:
            raise SystemExit(f"vLLM exited while starting; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.terminate()
            raise SystemExit(f"vLLM did not start in 900 s; see {log}")
        time.sleep(2)


def worker_reads(url: str) -> dict:
    """The connector's counters on vLLM's /metrics, per worker: what each loaded, read and rebuilt."""
    out = {}
    text = httpx.get(f"{url}/metrics").text
    for name, labels, value in re.findall(r"^vllm:milo_(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out.setdefault(f"tp{found['tp_rank']}-pp{found['pp_rank']}", {})[name] = float(value)
    return out


def complete(url: str, body: dict) -> tuple[dict, float]:
    t = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    response.raise_for_status()
    return response.json(), time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="banking77")
    p.add_argument("--store", action="append", required=True, metavar="NAME=DIR",
                   help="a store of the one build (repeat); NAME labels it in the results")
    p.add_argument("--n-queries", type=int, default=100)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timing-queries", type=int, default=16, help="queries per TTFT/qps measurement")
    p.add_argument("--timing-max-tokens", type=int, default=1,
                   help="tokens a timed request may answer (1: time to first token; 16: whole label answers, as "
                        "milo serve gives them, for queries/s beside tools/bench_serve.py)")
    p.add_argument("--milo-predictions", action="append", default=[], metavar="NAME=JSONL",
                   help="milo eval's predictions for store NAME (same queries), to compare with")
    p.add_argument("--no-prefill", action="store_true",
                   help="skip plain vLLM prefill (no agreement with it): only the stores, e.g. for queries/s")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--out", required=True)
    p.add_argument("vllm_args", nargs="*", help="after --: vLLM's own flags")
    args = p.parse_args()
    stores = dict(s.split("=", 1) for s in args.store)
    out = Path(args.out)
    url = f"http://127.0.0.1:{args.port}"
    _, test, task = load_dataset(args.dataset)
    test = test[:args.n_queries]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_directory("default"))
    opened = {name: MiloStore.open(path, tier="disk") for name, path in stores.items()}
    clients = {name: VllmPrompts(Path(stores[name]).name, store, tokenizer, settings=EngineSettings(k=args.k)) for name, store in opened.items()}
    first = next(iter(clients.values()))
    model = str(model_directory("default"))
    process = start(stores, args.port, out.with_suffix(".vllm.log"), args.vllm_args)
    results = {"dataset": args.dataset, "k": args.k, "n_queries": len(test), "date": time.strftime("%Y-%m-%d"),
               "answers": {}, "tokens": {}, "timing": {}}
    methods = [*clients] if args.no_prefill else ["prefill", *clients]
    try:
        prompts = [first.prompt(Request(text=q.input)) for q in test]
        for name, client in clients.items():  # one build: every store retrieves the same blocks
            assert [client.prompt(Request(text=q.input)).blocks for q in test[:5]] == [x.blocks for x in prompts[:5]]
        results["tokens"] = {"prompt": statistics.mean(len(x.prompt_token_ids) for x in prompts),
                             "prefix": statistics.mean(x.prefix_tokens for x in prompts)}
        for name in methods:
            texts, loaded = [], []
            for q, prompt in zip(test, prompts):
                body = (prompt if name == "prefill" else clients[name].prompt(Request(text=q.input))).body(
                    model, use_store=name != "prefill")
                r, _ = complete(url, body)
                texts.append(r["choices"][0]["text"].strip())
                loaded.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
            results["answers"][name] = texts
            results["tokens"][f"loaded {name}"] = statistics.mean(loaded)
            print(name, "done", flush=True)
            out.write_text(json.dumps(results, indent=1))
        for c in (1, args.concurrency):
            for name in methods:
                bodies = [(x if name == "prefill" else clients[name].prompt(Request(text=q.input))).body(
                    model, max_tokens=args.timing_max_tokens, use_store=name != "prefill") for q, x in zip(test, prompts)]
                bodies = bodies[:args.timing_queries]
                t = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(c) as pool:
                    latencies = [s for _, s in pool.map(lambda b: complete(url, b), bodies)]
                wall = time.perf_counter() - t
                latency = "ttft_mean_s" if args.timing_max_tokens == 1 else "latency_mean_s"
                results["timing"][f"{name} c{c}"] = {latency: statistics.mean(latencies),
                                                    "qps": len(bodies) / wall}
                print(name, c, results["timing"][f"{name} c{c}"], flush=True)
                out.write_text(json.dumps(results, indent=1))
        results["workers"] = worker_reads(url)
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:  # vLLM's CPU workers can outlive a SIGTERM: never leave them running
            os.killpg(process.pid, 9)
            process.wait(10)
    references = [q.output for q in test]
    answers = results["answers"]
    milo = {}
    for spec in args.milo_predictions:
        name, path = spec.split("=", 1)
        by_id = {json.loads(line)["id"]: json.loads(line)["prediction"] for line in open(path)}
        milo[name] = [by_id.get(q.id) for q in test]
    summary = {}
    for name, texts in answers.items():
        row = {"accuracy": sum(is_correct(t, r, task.answer_kind) for t, r in zip(texts, references)) / len(texts)}
        if "prefill" in answers:
            row["agree_prefill"] = sum(t == u for t, u in zip(texts, answers["prefill"])) / len(texts)
        if name in milo:
            pairs = [(t, m) for t, m in zip(texts, milo[name]) if m is not None]
            row["agree_milo"] = sum(t == m for t, m in pairs) / len(pairs) if pairs else None
        summary[name] = row
    results["summary"] = summary
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps({"summary": summary, "timing": results["timing"], "tokens": results["tokens"],
                      "workers": results.get("workers")}, indent=1))


if __name__ == "__main__":
    main()
