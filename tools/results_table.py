"""One results table from several `milo eval` runs (e.g. different method sets run by different processes).

Run: ``.venv/bin/python tools/results_table.py A/results.json B/results.json [--header TEXT] --out DIR``:
rows are merged as tools/plot_results.py merges them (a row seen twice keeps the last) and written as
DIR/results.md and DIR/results.json by `milo_infer.evaluation.tables.write_tables`.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_results import load_rows  # noqa: E402

from milo_infer.evaluation.tables import write_tables  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.json files written by milo eval")
    ap.add_argument("--header", default="", help="text above the table")
    ap.add_argument("--out", required=True, metavar="DIR")
    args = ap.parse_args()
    md, _ = write_tables(load_rows(args.results), args.out, header=args.header)
    print(md.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
