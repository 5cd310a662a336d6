"""`milo` entry point. Each subcommand is a module with ``add_arguments(p)`` and ``run(args)``.

Every input error is reported as one line on stderr with exit code 2, whether argparse finds it
(a malformed option) or a subcommand does (a bad corpus, an occupied output path, ...).
"""
import argparse
import sys

from milo_store.errors import StoreError

from ..build import BuildError
from ..corpus import CorpusError, DatasetUnavailable
from ..models import ModelUnavailable, UnsupportedModelError
from . import CommandError, build, query

COMMANDS = {"build": build, "query": query}

# Errors that describe the user's input or environment, not a bug: no traceback for these.
INPUT_ERRORS = (CommandError, BuildError, CorpusError, DatasetUnavailable, ModelUnavailable, UnsupportedModelError,
                StoreError)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the command (not the usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = OneLineParser(prog="milo", description="Build and use milo KV-cache stores for many-shot ICL.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a parse error already printed: return its code instead of raising
        return e.code
    try:
        return args.run(args) or 0
    except INPUT_ERRORS as e:
        print(f"milo {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
