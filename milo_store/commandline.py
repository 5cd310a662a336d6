"""What the `milo-store` and `milo` command lines share: subcommand dispatch, one-line errors, JSON output."""
import argparse
import json
import sys


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line naming the command (not the usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def run_subcommands(prog: str, description: str, commands: dict, input_errors: tuple, argv=None) -> int:
    """Dispatch to ``commands`` (name -> module with add_arguments and run).

    An error in ``input_errors`` describes the user's input, not a bug: one line on stderr, exit 2.
    """
    parser = OneLineParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in commands.items():
        p = sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a parse error already printed: return its code instead of raising
        return e.code
    try:
        return args.run(args) or 0
    except input_errors as e:
        print(f"{prog} {args.command}: {e}", file=sys.stderr)
        return 2
