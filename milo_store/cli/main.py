"""`milo-store`: inspect stores. One subcommand per module, each with add_arguments and run."""
import sys

from ..commandline import run_subcommands
from ..errors import StoreError
from . import cache, gc, ls, push, stat, verify

COMMANDS = {"ls": ls, "stat": stat, "verify": verify, "push": push, "gc": gc, "cache": cache}


def main(argv=None) -> int:
    return run_subcommands("milo-store", "Inspect milo KV stores.", COMMANDS, (StoreError,), argv)


if __name__ == "__main__":
    sys.exit(main())
