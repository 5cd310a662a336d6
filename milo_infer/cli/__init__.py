"""`milo`: build stores from demonstrations, query them, evaluate and benchmark. One subcommand per
module; what they share is here: the input error, the numeric flag checks, loading --model."""
from ..models import load_model


class CommandError(Exception):
    """Bad input to a subcommand: `main` prints the message as one line on stderr and exits 2."""


def at_least(args, minimum: int, *flags: str) -> None:
    """Each of ``flags`` (argparse attribute names) that was given must be at least ``minimum``: checked
    before any long work, the first one below it is a CommandError naming its flag."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < minimum:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least {minimum}; got {value}")


def load_model_arg(spec: str):
    """`load_model` of --model; what a bad one raises (no such path, not a model folder, an unsupported
    model) becomes a CommandError naming the flag."""
    try:
        return load_model(spec)
    except (OSError, ValueError) as e:
        raise CommandError(f"--model: {e}") from None
