"""Formatting shared by the subcommands."""
import json


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))
