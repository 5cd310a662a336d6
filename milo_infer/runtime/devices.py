"""The compute device a command asks for, checked before a model is loaded onto it."""
import torch

from .session import default_device


def usable_device(name: str | None) -> torch.device:
    """``name`` as a device this torch can use (default: `default_device`). An unknown name, or CUDA on a
    torch built without it or on a machine without a GPU, is a ValueError saying so: found after the
    model loaded, it would be a traceback (torch asserts) instead of an answer to the flag."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
        torch.zeros(1, device=device)  # allocates and runs on it: an absent ordinal fails here too
    except (RuntimeError, AssertionError) as e:  # torch asserts when it was built without CUDA
        raise ValueError(f"not usable here ({e})") from None
    return device
