"""`milo` entry point. Each subcommand is a module with ``add_arguments(p)`` and ``run(args)``.

Every input error is reported as one line on stderr with exit code 2, whether argparse finds it
(a malformed option) or a subcommand does (a bad corpus, an occupied output path, ...).
"""
import sys

from milo_store.cli.common import run_subcommands
from milo_store.allocation import BudgetError
from milo_store.errors import StoreError
from milo_store.staging import StagingError

from ..build import BuildError
from ..corpus import CorpusError, DatasetUnavailable
from ..distributed import RankError
from ..models import ModelUnavailable, UnsupportedModelError
from . import CommandError, bench, build, eval, query, serve

COMMANDS = {"build": build, "query": query, "eval": eval, "bench": bench, "serve": serve}

# Errors that describe the user's input or environment, not a bug: no traceback for these.
INPUT_ERRORS = (CommandError, BuildError, BudgetError, CorpusError, DatasetUnavailable, ModelUnavailable,
                UnsupportedModelError, StoreError, StagingError, RankError)


def main(argv=None) -> int:
    return run_subcommands("milo", "Build and use milo KV-cache stores for many-shot ICL.", COMMANDS, INPUT_ERRORS, argv)


if __name__ == "__main__":
    sys.exit(main())
