"""`milo-store`: inspect stores. One subcommand per module, each with add_arguments and run."""
import argparse
import sys

from ..errors import StoreError
from . import ls, stat, verify

COMMANDS = {"ls": ls, "stat": stat, "verify": verify}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="milo-store", description="Inspect milo KV stores.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except StoreError as e:
        print(f"milo-store {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
