"""Per-block CRC32C (hardware-accelerated through google-crc32c, which zarr already depends on)."""
import google_crc32c
import numpy as np
import torch


def crc32c(data) -> int:
    """CRC32C of a contiguous tensor's or array's raw bytes."""
    if isinstance(data, torch.Tensor):
        data = data.contiguous().view(torch.uint8).numpy()
    return google_crc32c.value(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
