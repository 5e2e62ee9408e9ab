"""bench/gpu_check.sh's dry run (issue 36, target 5): every step of the GPU check but the CUDA
ones, on the CPU with tiny workloads, so the script is ready the first time a GPU is at hand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- gpu-check:begin -->", "<!-- gpu-check:end -->"
STEPS = ["device", "batched", "flower", "llama1b", "decoder"]


def _rows(text: str) -> list[list[str]]:
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ")]
    return rows[1:]  # less the header


def test_benchmarks_has_the_gpu_check_section_and_no_dry_figures():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert text.count(BEGIN) == text.count(END) == 1 and text.index(BEGIN) < text.index(END)
    assert "dry run" not in text.split(BEGIN, 1)[1].split(END, 1)[0]


# Ray (the Flower baseline) beside the Flower simulation test's Ray: one worker for both (the
# "ray" group), beside the deployment group's worker (tests/test_flower.py: needs_flower)
@pytest.mark.xdist_group("ray")
def test_dry_run_runs_every_step_and_writes_only_its_table(tmp_path):
    original = (REPO / "BENCHMARKS.md").read_text()
    results = {f: f.read_bytes() for f in (REPO / "bench" / "results").rglob("*.json")}
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text(original)
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--dry", "--benchmarks", str(bench)],
                         cwd=REPO, env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    text = bench.read_text()
    rows = _rows(text)
    assert [r[0] for r in rows] == STEPS, rows
    assert all(r[-1] == "dry run: ok" for r in rows), rows
    assert "dry run on the CPU" in text.split(BEGIN, 1)[1]
    assert text.split(BEGIN)[0] == original.split(BEGIN)[0]
    assert text.split(END)[1] == original.split(END)[1]
    # the benchmarks' standard result files are not overwritten by the tiny workloads
    assert {f: f.read_bytes() for f in (REPO / "bench" / "results").rglob("*.json")} == results


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the real check would run")
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--benchmarks", str(tmp_path / "B.md")],
                         cwd=REPO, env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "no CUDA GPU visible" in out.stderr
    assert not (tmp_path / "B.md").exists()
