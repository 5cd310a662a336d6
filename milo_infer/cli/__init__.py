"""`milo`: build, query, evaluate, benchmark and serve stores. One subcommand per module."""


class CommandError(Exception):
    """Bad input to a subcommand: `main` prints the message as one line on stderr and exits 2."""


def load_placed_model(model: str, device: str | None):
    """The model loaded and moved to ``device`` (None: the GPU if any), and the device; bad values are CommandErrors."""
    from ..models import load_model
    from ..session import place_model

    try:
        loaded = load_model(model)
    except (OSError, ValueError) as e:  # no such path, not a model folder, an unsupported model
        raise CommandError(f"--model: {e}") from None
    try:
        return loaded, place_model(loaded, device)
    except RuntimeError as e:  # e.g. an unknown or absent device
        raise CommandError(f"--device {device}: {e}") from None
