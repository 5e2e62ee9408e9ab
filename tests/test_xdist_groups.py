"""make test runs the suite with pytest-xdist's ``--dist loadgroup``: the tests of one
``xdist_group`` (the Flower deployment tests) must all run on one worker."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

MODULE = """
import time
import pytest

@pytest.mark.xdist_group("deployment")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    time.sleep(0.3)

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    time.sleep(0.3)
"""


def test_a_group_runs_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from xdist_groups import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_groups.py").write_text(MODULE)
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                          "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    ran = re.findall(r"\[(gw\d)\] .*PASSED .*::(test_\w+)\[(\d)\](@\w+)?", out.stdout)
    grouped = {(w, s) for w, name, _, s in ran if name == "test_grouped"}
    assert len(ran) == 8 and len(grouped) == 1 and next(iter(grouped))[1] == "@deployment", ran
