"""tools/plot_results.py: merging eval result files into per-method curves, and the figure."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from plot_results import curves, load_rows, plot  # noqa: E402


def _row(method, seed, ratio, acc, measured, block=32, k=6):
    return {"dataset": "d", "seed": seed, "method": method, "ratio_setting": ratio, "block_size": block, "k": k,
            "accuracy": acc, "store_ratio": measured, "n": 10}


def test_curves_average_seeds_and_merge_files_with_later_rows_winning(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps([_row("milo", 0, 0.5, 0.1, 0.49), _row("milo", 1, 0.5, 0.3, 0.51),
                             _row("milo", 0, 0.25, 0.2, 0.24), _row("full", 0, 1.0, 0.9, 1.08)]))
    b.write_text(json.dumps([_row("milo", 0, 0.25, 0.0, 0.25)]))  # replaces the first run's row
    rows = load_rows([str(a), str(b)])
    got = curves(rows, "ratio")
    (x1, y1, e1), (x2, y2, e2) = got["milo"]
    assert (x1, y1, e1) == (0.25, 0.0, 0.0)
    assert x2 == pytest.approx(0.5) and y2 == pytest.approx(20.0) and e2 == pytest.approx(14.142, abs=1e-3)
    assert got["full"] == [(1.08, 90.0, 0.0)]
    assert load_rows([str(a)], methods=["full"]) == [_row("full", 0, 1.0, 0.9, 1.08)]
    with pytest.raises(SystemExit, match="no rows"):
        load_rows([str(a)], dataset="other")


def test_agreement_curves_leave_out_rows_without_one(tmp_path):
    rows = [{**_row("full", 0, 1.0, 0.9, 1.08), "agreement": None},
            {**_row("raw+int8", 0, 1.0, 0.8, 0.50), "agreement": 0.9},
            {**_row("milo", 0, 0.5, 0.7, 0.5), "agreement": 0.95}, {**_row("milo", 1, 0.5, 0.7, 0.5), "agreement": 0.85}]
    got = curves(rows, "ratio", "agreement")
    assert "full" not in got and got["raw+int8"] == [(0.50, 90.0, 0.0)]
    (x, y, e), = got["milo"]
    assert y == pytest.approx(90.0) and e == pytest.approx(7.071, abs=1e-3)
    assert Path(plot(rows, "ratio", str(tmp_path / "a.png"), y="agreement")).read_bytes()[:4] == b"\x89PNG"


def test_block_size_curve_and_figure_is_written(tmp_path):
    rows = [_row("milo", 0, 0.5, 0.2, 0.5, block=16), _row("milo", 0, 0.5, 0.4, 0.5, block=64)]
    assert curves(rows, "block_size")["milo"] == [(16, 20.0, 0.0), (64, 40.0, 0.0)]
    out = plot(rows, "block_size", str(tmp_path / "fig.png"))
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no block_size"):
        curves([{**rows[0], "block_size": None}], "block_size")


def test_rows_that_differ_in_another_setting_make_separate_curves_not_an_average():
    rows = [_row("milo", 0, 0.5, 0.2, 0.5, block=16), _row("milo", 0, 0.5, 0.4, 0.5, block=64, k=3)]
    got = curves(rows, "ratio")
    assert got == {"milo m=16 k=6": [(0.5, 20.0, 0.0)], "milo m=64 k=3": [(0.5, 40.0, 0.0)]}


def test_against_block_size_k_goes_with_the_block_size():
    rows = [_row("milo", 0, 0.5, 0.2, 0.5, block=16, k=12), _row("milo", 0, 0.5, 0.4, 0.5, block=64, k=3)]
    assert curves(rows, "block_size") == {"milo": [(16, 20.0, 0.0), (64, 40.0, 0.0)]}


def test_results_table_merges_runs_into_one_table(tmp_path):
    import subprocess

    full = {**_row("full", 0, 1.0, 0.9, 1.08), "store_bytes": 108, "store_full_fp16_bytes": 100,
            "query_kv_bytes_stored": 1, "query_kv_bytes_full": 1, "agreement": None}
    other = {**full, "method": "raw+int8", "accuracy": 0.8, "store_bytes": 50, "agreement": 0.9}
    (tmp_path / "a.json").write_text(json.dumps([full]))
    (tmp_path / "b.json").write_text(json.dumps([other]))
    tool = Path(__file__).resolve().parents[3] / "tools" / "results_table.py"
    subprocess.run([sys.executable, str(tool), str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                    "--out", str(tmp_path / "t")], check=True, capture_output=True, timeout=120)
    text = (tmp_path / "t" / "results.md").read_text()
    assert "| full | 90.0 |" in text and "| raw+int8 | 80.0 [90%] |" in text
    assert json.loads((tmp_path / "t" / "results.json").read_text()) == [full, other]
