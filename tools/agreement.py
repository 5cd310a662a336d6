"""Accuracy of two methods' predictions (milo eval's JSONL files) on the items both answered, and how often they agree.

Run: ``python tools/agreement.py FULL.jsonl OTHER.jsonl [--first N]``: the first N items of FULL (in its
order, the test order) that OTHER answered too.
"""
import argparse
import json


def read(path: str) -> dict[str, dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["id"]: r for r in rows}


def compare(reference: dict[str, dict], other: dict[str, dict], first: int | None = None) -> dict:
    ids = [i for i in reference if i in other][:first]
    return {"n": len(ids),
            "reference_accuracy": sum(reference[i]["correct"] for i in ids) / len(ids) if ids else None,
            "other_accuracy": sum(other[i]["correct"] for i in ids) / len(ids) if ids else None,
            "agree": sum(reference[i]["prediction"] == other[i]["prediction"] for i in ids)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--first", type=int, default=None)
    args = ap.parse_args()
    print(json.dumps(compare(read(args.reference), read(args.other), args.first)))


if __name__ == "__main__":
    main()
