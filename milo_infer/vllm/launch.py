"""vLLM's OpenAI server with the milo connector over stores: run with the python of vLLM's venv.

    .venv-vllm/bin/python -m milo_infer.vllm.launch stores/banking77 [--tier disk] -- --port 8001 [vLLM's flags]

Each store is named by its basename, as `milo serve` names it, so ``milo serve --vllm URL`` over the
same stores finds them. The model is the stores' (``--model``, default the default model's HF
directory); prefix caching is left as vLLM's default (loaded prefixes then also serve later requests
from vLLM's own cache). Everything after ``--`` goes to vLLM unchanged.
"""
import argparse
import json
import os
import sys
from pathlib import PurePosixPath

from ..models import model_directory
from .transfer import connector_config


def command(stores: list[str], model: str = "default", tier: str = "host", load_failure: str = "recompute",
            vllm_args: tuple[str, ...] = (), python: str = sys.executable) -> list[str]:
    """The command line that starts vLLM's server with the connector over ``stores``."""
    names = [PurePosixPath(str(s).rstrip("/")).name for s in stores]
    if len(set(names)) != len(names):
        raise SystemExit(f"two stores share a basename ({', '.join(names)}): rename one")
    config = connector_config(dict(zip(names, stores)), load_failure=load_failure, tier=tier)
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_directory(model)),
            "--kv-transfer-config", json.dumps(config), *vllm_args]


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m milo_infer.vllm.launch", description=__doc__.splitlines()[0])
    p.add_argument("store", nargs="+", help="store directories or URLs")
    p.add_argument("--model", default="default", help="the stores' model: 'default', an HF directory or a .gguf")
    p.add_argument("--tier", default="host", choices=("host", "disk", "cached"), help="how the connector mounts them")
    p.add_argument("--load-failure", default="recompute", choices=("recompute", "fail"),
                   help="a request whose blocks cannot be read: vLLM recomputes it (default) or fails it")
    args = p.parse_args(ours)
    cmd = command(args.store, args.model, args.tier, args.load_failure, tuple(rest))
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
