"""The HTML report (issue 25, part 3): self-contained, and rendered in a real headless browser
(Debian's Chromium; `.ci/run` installs it) at phone width, where every figure and table must be
laid out with a size and nothing may overflow the window."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from fedslice.api import compare_experiments
from fedslice.experiment import validate_config
from fedslice.html_report import REPORT
from fedslice.methods import method_class

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]

#: Injected into a copy of the report: what the browser laid out, as JSON in #check.
CHECK = """<script>
const box = e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
document.querySelectorAll('details').forEach(d => d.open = true);
const figs = [...document.querySelectorAll('svg.figure')];
const tables = [...document.querySelectorAll('table')];
const out = {figures: figs.length, figures_laid_out: figs.filter(box).length,
  figures_in_window: figs.filter(f => f.getBoundingClientRect().right <= window.innerWidth + 1).length,
  tables: tables.length, tables_laid_out: tables.filter(box).length,
  sections: [...document.querySelectorAll('section h2')].map(h => h.textContent),
  page_width: document.documentElement.scrollWidth, window_width: window.innerWidth,
  external: [...document.querySelectorAll('[src],link[href],script[src]')].length};
const pre = document.createElement('pre'); pre.id = 'check'; pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("CI"):
        pytest.fail("Chromium is missing in CI: .ci/run installs Debian's chromium package")
    return found


def browser_check(path, tmp_path, width: int = 390) -> dict:
    exe = chromium()
    if exe is None:
        pytest.skip("no chromium here (`apt-get install chromium`; CI installs it)")
    page = tmp_path / f"check-{path.parent.name}.html"
    page.write_text(path.read_text().replace("</body>", CHECK + "</body>"))
    proc = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                           f"--window-size={width},900", "--virtual-time-budget=3000",
                           "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="check">(.*?)</pre>', proc.stdout, re.S)
    assert m, proc.stderr[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def test_run_and_compare_reports_render_in_a_browser(tiny_cfg_dict, tmp_path):
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["output"]["plots"] = True
    d["data"]["partition"] = "dirichlet"
    heads = {**d, "name": "heads", "method": {"name": "heads", "sparsity": 0.5}}
    base = {**d, "name": "lora"}
    folder, _ = compare_experiments([validate_config(base), validate_config(heads)],
                                    tmp_path / "runs", progress=False, name="cmp")
    run = folder / "heads" / REPORT
    text = run.read_text()
    # self-contained: no script, stylesheet, image or font fetched from anywhere
    assert not re.search(r"<script|<link|<img|@import|url\((?!#)", text)  # url(#id): in the page
    assert not re.search(r'(src|href)="(https?:)?//', text)
    got = browser_check(run, tmp_path)
    expected = ["Results", "accuracy per round", "Loss per round", "Bytes per round",
                "FLOPs per round", "Per-client costs", "Partition: label histogram",
                "Head importance (heads method)", "Heads kept (heads method)",
                "Head importance per client (heads method)",
                "Distance between clients' head importance (heads method)", "Config", "Files"]
    assert got["sections"] == expected
    assert got["figures"] == got["figures_laid_out"] == got["figures_in_window"] == 10
    # the results table and one data table per figure
    assert got["tables"] == got["tables_laid_out"] == 11
    assert got["page_width"] <= got["window_width"] and got["external"] == 0  # phone width: no overflow
    cmp = browser_check(folder / REPORT, tmp_path)
    assert cmp["figures"] == cmp["figures_laid_out"] == 1 and cmp["tables_laid_out"] == 2
    assert cmp["page_width"] <= cmp["window_width"]
    assert 'href="heads/report.html"' in (folder / REPORT).read_text()


def test_method_views_of_raffm_and_fedpft(tmp_path):
    elastic = [{"size": s, "metric": "accuracy", "test_accuracy": a, "dev_accuracy": a - 0.01,
                "params": 10, "forward_gflops_per_example": s} for s, a in ((0.5, 0.7), (1.0, 0.8))]
    (view,) = method_class("raffm").report_views(tmp_path, {}, [], {"elastic": elastic})
    assert view.svg.startswith("<svg") and [r["test accuracy"] for r in view.rows] == [0.7, 0.8]
    losses = [{"loss": 1.0 / (i + 1), "kd": 0.5} for i in range(4)]
    (tmp_path / "fedpft_distill.json").write_text(json.dumps(
        {"phases": {"layer-level KD before FL": {"losses": losses}}}))
    (view,) = method_class("fedpft").report_views(tmp_path, {}, [], {})
    assert [r["layer-level KD before FL"] for r in view.rows] == [x["loss"] for x in losses]
    assert method_class("fedavg").report_views(tmp_path, {}, [], {}) == []
