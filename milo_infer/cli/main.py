"""`milo` entry point. Each subcommand is a module with ``add_arguments(p)`` and ``run(args)``.

Every input error is reported as one line on stderr with exit code 2, whether argparse finds it
(a malformed option) or a subcommand does (a bad corpus, an occupied output path, ...).
"""
import sys

from milo_store.commandline import run_subcommands

from . import bench, build, check_model, eval, query, serve, update
from .errors import INPUT_ERRORS

COMMANDS = {"check-model": check_model, "build": build, "update": update, "query": query, "eval": eval, "bench": bench, "serve": serve}


def main(argv=None) -> int:
    return run_subcommands("milo", "Build and use milo KV-cache stores for many-shot ICL.", COMMANDS, INPUT_ERRORS, argv)


if __name__ == "__main__":
    sys.exit(main())
