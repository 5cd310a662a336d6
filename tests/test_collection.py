"""Every test file on disk is collected by the README's test command (`make test`: pytest over the
pyproject's testpaths). pytest skips folders named ``build``, ``dist``, ``venv``, ... without a word; the
store-building room's 71 tests once sat in ``tests/infer/build`` and never ran."""
import os
import subprocess
import sys

import pytest

from tests.conftest import TESTS, missing_test_files


def test_every_test_file_is_collected(pytestconfig):
    if pytestconfig.args_source == pytest.Config.ArgsSource.TESTPATHS:
        missing = missing_test_files()  # this session is the README's: its own collection counts
    else:  # run alone or on a folder: ask a collection of the whole suite, as `make test` makes it
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                             cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
        line = next((l for l in out.splitlines() if l.startswith("test files: ")), None)
        assert line is not None, f"the collection printed no count of test files:\n{out[-2000:]}"
        missing = line.partition("; not collected: ")[2].split(", ") if "not collected" in line else []
    assert not missing, f"the README's test command does not collect {len(missing)} test file(s): {', '.join(missing)}"
