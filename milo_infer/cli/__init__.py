"""`milo`: build stores from demonstrations (and, later, query them). One subcommand per module."""


class CommandError(Exception):
    """Bad input to a subcommand: `main` prints the message as one line on stderr and exits 2."""
