"""What the `milo-store` and `milo` command lines share: subcommand dispatch, one-line errors, JSON output."""
import argparse
import io
import json
import os
import sys


def id_list(values: list[str] | None) -> list[str]:
    """Demonstration ids given as one or more comma-separated lists (``--absent a,b --absent c``), in order, once each."""
    return list(dict.fromkeys(i.strip() for v in values or () for i in v.split(",") if i.strip()))


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
        code = args.run(args) or 0
        sys.stdout.flush()  # so a reader that closed the pipe is found here, not at exit
        return code
    except input_errors as e:
        print(f"{prog} {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `| head -1`: the reader has what it wanted; stop quietly
        _discard_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a process killed by a closed pipe


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so what is still buffered is not flushed into the closed pipe at exit."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # stdout is not a file descriptor (replaced in tests)
        pass
