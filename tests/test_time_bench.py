"""bench/time_to_accuracy.py (issue 59 part 4) on the tiny model: every row runs to its
simulated-time budget (2 t*, t* = when ``all`` first reached its round-N dev metric), the dev
metric is measured on the model available at each time point, the planner's clients reply
within the deadline, a finished piece is reused, and the table and plot are written."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "time_to_accuracy.py"


@pytest.fixture
def bench(monkeypatch, tiny_model_dir, tiny_data_dir):
    spec = importlib.util.spec_from_file_location("time_to_accuracy", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(mod.WORKLOADS, "tiny", (
        {"data": {"path": str(tiny_data_dir), "partition": "iid"}, "model": {"name": str(tiny_model_dir)}},
        "accuracy", True))
    monkeypatch.setitem(mod.DEFAULTS, "tiny", dict(
        clients=6, per_round=2, local_steps=2, batch_size=4, max_length=16, lr=5e-3,
        dev_examples=16, target_rounds=4, all_eval_every=2, gflops=0.02))
    return mod


def test_every_row_runs_to_the_budget_and_is_reused(bench, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["--workload", "tiny", "--seeds", "0", "--out", str(out), "--threads", "1"]
    # a report reads the pieces that have run and starts none
    assert bench.main(argv + ["--report", str(out / "none.md")]) == 0
    assert not list(out.glob("*.json")) and "| all |" not in (out / "none.md").read_text()
    assert bench.main(argv) == 0
    assert bench.main(argv + ["--report", str(out / "tiny.md")]) == 0
    pieces = {r: json.loads((out / f"tiny-seed0-{r}.json").read_text()) for r in bench.ROWS}
    ref = pieces["all"]["ref"]
    budget = 2 * ref["t_star"]
    all_ = pieces["all"]
    # the target is all's dev metric after target_rounds rounds; t* the first time it was reached
    sm = bench.smoothed(all_["evals"], 3)  # the running mean of three measurements
    i = next(i for i, e in enumerate(all_["evals"]) if e["round"] == 4)
    window = [e["metric"] for e in all_["evals"][max(0, i - 2):i + 1]]
    assert ref["target"] == sm[i] == pytest.approx(sum(window) / len(window), abs=1e-12)
    assert ref["t_target"] == all_["evals"][i]["t"]
    assert ref["t_star"] == next(e["t"] for e, v in zip(all_["evals"], sm) if v >= ref["target"])
    for row, p in pieces.items():
        assert p["complete"], row
        times = [r["sim_time_s"] for r in p["records"]]
        # it stopped at the first round that ended at or after the budget (all: not before
        # the round that sets the target)
        first = next(i for i, t in enumerate(times, 1) if t >= budget - 1e-9)
        assert len(times) == (max(first, 4) if row == "all" else first), row
        # the model measured at time t is the last one published by then
        for e in p["evals"]:
            published = [r["round"] for r in p["records"] if r["sim_time_s"] <= e["t"] + 1e-9]
            assert e["round"] == published[-1], (row, e)
        assert any(abs(e["t"] - budget) < 1e-9 for e in p["evals"]) or row == "all"
    deadline = ref["deadline_s"]
    assert pieces["deadline"]["config"]["federation"]["round_deadline_s"] == deadline
    planned = [m for r in pieces["planner"]["records"] for m in r["client_metrics"]]
    assert planned and all(m["sim_s_predicted"] <= deadline * (1 + 1e-9) for m in planned)
    assert all(m["sim_s"] <= deadline * (1 + 1e-9) for m in planned)
    # each client-round predicted from its own batches: its simulated seconds, to rounding
    assert all(m["sim_s"] == pytest.approx(m["sim_s_predicted"], rel=1e-9) for m in planned)
    assert all(r["wasted_flops"] == 0 for r in pieces["planner"]["records"])
    assert all(r["staleness_mean"] is not None for r in pieces["async"]["records"])
    table = (out / "tiny.md").read_text()
    assert all(f"| {r} | 0 |" in table for r in bench.ROWS)
    assert (out / "tiny.png").stat().st_size > 0
    # a finished piece is read back, not run again
    stamp = {r: (out / f"tiny-seed0-{r}.json").stat().st_mtime_ns for r in bench.ROWS}
    capsys.readouterr()
    assert bench.main(argv) == 0
    assert "running" not in capsys.readouterr().out
    assert stamp == {r: (out / f"tiny-seed0-{r}.json").stat().st_mtime_ns for r in bench.ROWS}


def test_clock_overhead_times_both_arms(tiny_model_dir, tiny_data_dir, capsys):
    spec = importlib.util.spec_from_file_location("clock_overhead", BENCH.with_name("clock_overhead.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ratios = mod.main(["--reps", "2", "--threads", "1", "--clients", "4", "--per-round", "2",
                       "--rounds", "2", "--dev-examples", "8", "--max-length", "16",
                       "--data", str(tiny_data_dir), "--model", str(tiny_model_dir)])
    out = capsys.readouterr().out
    assert set(ratios) == {"total", "rounds"} and all(r > 0 for r in ratios.values())
    assert out.count("with devices:") == 2 and out.count("without devices:") == 2
    assert "uptime before:" in out and "uptime after:" in out and "ratio" in out


def test_a_loss_workload_targets_the_lowest(bench, tmp_path, tiny_lm_dirs, tiny_d2t_dir, monkeypatch):
    """A generative workload's metric is the dev loss: the target is all's round-N loss, t* the
    first time the loss was at most that."""
    monkeypatch.setitem(bench.WORKLOADS, "tinygen", (
        {"data": {"path": str(tiny_d2t_dir)}, "model": {"name": str(tiny_lm_dirs["llama"])},
         "task": {"kind": "generation", "prompt": "Describe the restaurant: {mr}\n",
                  "target": "{ref}", "max_target_length": 16, "max_new_tokens": 4}}, "loss", False))
    monkeypatch.setitem(bench.DEFAULTS, "tinygen", dict(
        clients=3, per_round=2, local_steps=1, batch_size=4, max_length=32, lr=5e-3,
        dev_examples=8, target_rounds=3, all_eval_every=1, gflops=0.02))
    out = tmp_path / "gen"
    assert bench.main(["--workload", "tinygen", "--seeds", "0", "--out", str(out), "--threads", "1",
                       "--rows", "all", "async"]) == 0
    all_ = json.loads((out / "tinygen-seed0-all.json").read_text())
    ref = all_["ref"]
    sm = bench.smoothed(all_["evals"], 3)
    assert ref["target"] == next(v for e, v in zip(all_["evals"], sm) if e["round"] == 3)
    assert ref["t_star"] == next(e["t"] for e, v in zip(all_["evals"], sm) if v <= ref["target"])
    assert all(e["metric"] > 0 for e in all_["evals"])  # a loss, not an accuracy
    assert (out / "tinygen-seed0-async.json").is_file()
    # the easier targets of a loss are nats above all's (points of accuracy would be whole nats)
    assert bench.main(["--workload", "tinygen", "--seeds", "0", "--out", str(out), "--rows", "all",
                       "async", "--report", str(out / "gen.md")]) == 0
    text = (out / "gen.md").read_text()
    assert "| all's round-3 value + 0.05 nats |" in text and "+ 1 " not in text


def test_settings_are_rows_of_their_own(bench, tmp_path):
    """``planner@p50`` plans to the 50th percentile of all's client-round times, ``async@3x1``
    runs FedBuff with concurrency 3 and buffer 1; each is its own piece and its own table row."""
    out = tmp_path / "settings"
    argv = ["--workload", "tiny", "--seeds", "0", "--out", str(out), "--threads", "1",
            "--rows", "all", "planner@p50", "async@3x1"]
    assert bench.main(argv) == 0
    assert bench.main(argv + ["--report", str(out / "tiny.md"), "--plot-rows", "planner@p50"]) == 0
    all_ = json.loads((out / "tiny-seed0-all.json").read_text())
    secs = [m["sim_s"] for r in all_["records"][:4] for m in r["client_metrics"]]
    planner = json.loads((out / "tiny-seed0-planner-p50.json").read_text())
    deadline = float(bench.np.quantile(secs, 0.5))
    assert planner["ref"]["deadline_s"] == deadline != all_["ref"]["deadline_s"]
    assert planner["config"]["federation"]["round_deadline_s"] == deadline
    assert planner["config"]["budgets"]["tiers"][0]["seconds_per_round"] == deadline
    assert all(m["sim_s"] <= deadline * (1 + 1e-9) for r in planner["records"] for m in r["client_metrics"])
    fed = json.loads((out / "tiny-seed0-async-3x1.json").read_text())["config"]["federation"]
    assert (fed["concurrency"], fed["buffer_size"]) == (3, 1)
    table = (out / "tiny.md").read_text()
    assert "| planner@p50 | 0 |" in table and "| async@3x1 | 0 |" in table
    assert (out / "tiny.png").stat().st_size > 0
    # a cheaper piece: to 1.5 t* at most, stopped once the target is reached
    assert bench.main(argv[:-3] + ["planner@p50", "--budget-x", "1.5", "--stop-at-target"]) == 0
    short = json.loads((out / "tiny-seed0-planner-p50-to1.5t-stop.json").read_text())
    assert short["budget_s"] == pytest.approx(1.5 * all_["ref"]["t_star"])
    sm = bench.smoothed(short["evals"], 3)
    reached = [i for i, v in enumerate(sm) if v >= short["ref"]["target"]]
    if short["stopped_at_target"]:
        assert reached == [len(sm) - 1]  # stopped at the first measurement that reached it
    else:
        assert not reached and short["records"][-1]["sim_time_s"] >= short["budget_s"] - 1e-9
    assert bench.piece_stats(short, True, 3)["at_budget"] is None  # no value at 2 t*
    with pytest.raises(SystemExit):
        bench.main(argv[:-3] + ["--rows", "async@p30"])
    assert bench.parse_variant("planner@p30+fit") == ("planner", {"quantile": 0.3, "fit_rounds": True})
    args = argparse.Namespace(**bench.DEFAULTS["tiny"], workload="tiny", threads=1, max_rounds=10,
                              upload=1.0, download=5.0, availability=0.7, speed_sigma=0.9,
                              adapter_depths=[1.0], ranks=[16], on_infeasible="error")
    fit = bench.row_config(args, 0, "planner@p30+fit", {"deadline_s": 1.0})
    assert fit["budgets"]["fit_rounds"] is True and "fit_rounds" not in \
        bench.row_config(args, 0, "planner@p30", {"deadline_s": 1.0})["budgets"]
    floor = argparse.Namespace(**{**vars(args), "on_infeasible": "sit_out", "ranks": [16, 8]})
    planned = bench.row_config(floor, 0, "planner@p30", {"deadline_s": 1.0})  # --on-infeasible
    assert planned["budgets"]["on_infeasible"] == "sit_out" and planned["lora"]["ranks"] == [16, 8]


def test_async_settings_take_the_staleness_exponent_and_the_server_lr(bench):
    """``async@10x5+a1+lr2``: FedBuff's knobs beside concurrency x buffer, each a config field;
    a knob the bench does not know is an error, not a silent default."""
    assert bench.parse_variant("async@10x5+a0+lr2") == (
        "async", {"concurrency": 10, "buffer_size": 5, "staleness_exponent": 0.0, "server_lr": 2.0})
    args = argparse.Namespace(**bench.DEFAULTS["tiny"], workload="tiny", threads=1, max_rounds=10,
                              upload=1.0, download=5.0, availability=0.7, speed_sigma=0.9,
                              adapter_depths=[1.0], ranks=[16], on_infeasible="error")
    fed = bench.row_config(args, 0, "async@4x2+a1", None)["federation"]
    assert (fed["concurrency"], fed["buffer_size"], fed["staleness_exponent"]) == (4, 2, 1.0)
    assert "server_lr" not in fed and "staleness_exponent" not in \
        bench.row_config(args, 0, "async@4x2", None)["federation"]
    for bad in ("async@10x5+b1", "async@10x5+a", "async@10x5+lr"):
        with pytest.raises(ValueError, match="staleness exponent"):
            bench.parse_variant(bad)


def test_a_report_reads_each_rows_piece_that_ran_furthest(bench, tmp_path):
    """Rows cut at different budgets share one report: a row without the piece the flags name
    is read from its full piece, else from its cut piece with the largest budget."""
    args = argparse.Namespace(workload="tiny", out=tmp_path, budget_x=2.0, stop_at_target=False)
    for name, budget in (("async-to0.5t-stop", 5.0), ("async-to0.6t-stop", 6.0),
                         ("async-10x5-a0-to0.7t-stop", 7.0), ("planner-p30-to0.4t", 4.0)):
        (tmp_path / f"tiny-seed0-{name}.json").write_text(json.dumps({"budget_s": budget}))
    assert bench.report_piece(args, 0, "async").name == "tiny-seed0-async-to0.6t-stop.json"
    assert bench.report_piece(args, 0, "planner@p30").name == "tiny-seed0-planner-p30-to0.4t.json"
    assert bench.report_piece(args, 0, "async@10x5+a0").name == "tiny-seed0-async-10x5-a0-to0.7t-stop.json"
    assert not bench.report_piece(args, 0, "deadline").is_file()
    (tmp_path / "tiny-seed0-async.json").write_text(json.dumps({"budget_s": 2.0}))  # full: first
    assert bench.report_piece(args, 0, "async").name == "tiny-seed0-async.json"
    short = argparse.Namespace(**{**vars(args), "budget_x": 0.5, "stop_at_target": True})
    assert bench.report_piece(short, 0, "async").name == "tiny-seed0-async-to0.5t-stop.json"


def test_a_sigterm_ends_the_piece_even_inside_a_replys_validation(bench):
    """`timeout`'s SIGTERM raises Interrupted wherever the run is; inside a reply's validation
    (an ``except Exception`` that rejects the reply and trains on) it must still end the piece."""
    from fedslice.fl.strategy import Payload, Reply, Strategy
    from fedslice.config import FederationConfig
    import torch

    class Validating(Strategy):
        def check_reply(self, state, payload, reply):
            raise bench.Interrupted  # the signal arrives here

    strategy = Validating(FederationConfig(num_clients=2, clients_per_round=1))
    state = {"w": torch.zeros(2)}
    with pytest.raises(bench.Interrupted):
        strategy.validate(state, Payload(dict(state), {}), Reply({"w": torch.ones(2)}, 1, {}))


def test_a_row_measured_every_round_compares_its_learning_per_round_with_alls(bench, tmp_path):
    """``--eval-rounds N``: a row other than all also measures its model every N rounds (each
    model once: the time grid's measurement of the same round is the same value), and the report
    sets its rounds per simulated second against its dev metric at the same rounds as all's."""
    out = tmp_path / "per-round"
    argv = ["--workload", "tiny", "--seeds", "0", "--out", str(out), "--threads", "1",
            "--rows", "all", "planner", "--eval-rounds", "1"]
    assert bench.main(argv) == 0
    assert bench.main(argv + ["--report", str(out / "tiny.md")]) == 0
    all_ = json.loads((out / "tiny-seed0-all.json").read_text())
    planner = json.loads((out / "tiny-seed0-planner.json").read_text())
    assert "round_evals" not in all_  # all is measured every --all-eval-every rounds as before
    ends = {r["round"]: r["sim_time_s"] for r in planner["records"]}
    assert [e["round"] for e in planner["round_evals"]] == list(ends)  # every round, at its end
    assert all(e["t"] == ends[e["round"]] for e in planner["round_evals"])
    value = {e["round"]: e["metric"] for e in planner["round_evals"]}
    assert planner["evals"] and all(e["metric"] == value[e["round"]] for e in planner["evals"])
    line = next(x for x in (out / "tiny.md").read_text().split("Learning per round")[1].splitlines()
                if x.startswith("| planner | 0 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    pace = lambda p: len(p["records"]) / p["records"][-1]["sim_time_s"]
    assert float(cells[2]) == pytest.approx(pace(planner) / pace(all_), abs=0.006)
    all_at = {e["round"]: e["metric"] for e in all_["evals"]}
    early = [(value[r] - all_at[r]) * 100 for r in value if r in all_at and r <= 4]
    assert cells[6] == f"{sum(early) / len(early):+.2f} ({len(early)})"


@pytest.mark.parametrize("row", ["planner", "async"])
def test_a_piece_ended_by_timeout_resumes_where_it_stood(bench, tmp_path, monkeypatch, row):
    """A piece that `timeout` ends is written as it stands (not complete) beside the checkpoint
    of its last round; the same command resumes it from there, and the piece it completes is the
    one an uninterrupted run writes (its rounds, clock, measurements), under either policy."""
    import shutil

    from fedslice.run.session import Rounds

    argv = lambda out: ["--workload", "tiny", "--seeds", "0", "--out", str(out), "--threads", "1",
                        "--rows", "all", row, "--eval-rounds", "1"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert bench.main(argv(whole)) == 0
    cut.mkdir()
    shutil.copy(whole / "tiny-seed0-all.json", cut)
    name = f"tiny-seed0-{row}.json"
    assert len(json.loads((whole / name).read_text())["records"]) >= 3
    original = Rounds.round_done
    hit = []

    def timeout_in_round_3(self, server_round, *args, **kwargs):
        if server_round == 3 and not hit:
            hit.append(server_round)
            raise bench.Interrupted  # as the SIGTERM handler does, wherever the run is
        return original(self, server_round, *args, **kwargs)

    monkeypatch.setattr(Rounds, "round_done", timeout_in_round_3)
    assert bench.main(argv(cut)) == bench.INTERRUPTED  # and it starts nothing more
    first = json.loads((cut / name).read_text())
    assert not first["complete"] and first["interrupted"] and len(first["records"]) == 2
    assert (cut / name).with_suffix(".partial").is_dir()
    assert bench.main(argv(cut)) == 0  # the same command: resumed after round 2
    a, b = (json.loads((d / name).read_text()) for d in (whole, cut))
    assert b["complete"] and not (cut / name).with_suffix(".partial").exists()
    for key in ("records", "evals", "round_evals", "budget_s", "ref"):
        assert a[key] == b[key], key
    assert "interrupted" not in b
    assert not (whole / name).with_suffix(".partial").exists()  # removed once a piece ends


def test_planner_and_async_settings_name_their_config_fields(bench):
    """``planner@p30+fp16+more2+zeros`` and ``async@10x5+avgm0.9+e0.1`` / ``+adam0.01``: each
    token one config field; a token the bench does not know is an error."""
    assert bench.parse_variant("planner@p30+fp16+more2+zeros") == (
        "planner", {"quantile": 0.3, "upload_dtypes": ["fp32", "fp16"], "max_local_work": 2.0,
                    "lora_padding": "zeros"})
    args = argparse.Namespace(**bench.DEFAULTS["tiny"], workload="tiny", threads=1, max_rounds=10,
                              upload=1.0, download=5.0, availability=0.7, speed_sigma=0.9,
                              adapter_depths=[1.0], ranks=[16], on_infeasible="error")
    d = bench.row_config(args, 0, "planner@p30+fp16+more2+zeros", {"deadline_s": 1.0})
    assert (d["budgets"]["upload_dtypes"], d["budgets"]["max_local_work"], d["lora"]["padding"]) == \
        (["fp32", "fp16"], 2.0, "zeros")
    plain = bench.row_config(args, 0, "planner@p30", {"deadline_s": 1.0})
    assert not {"upload_dtypes", "max_local_work"} & set(plain["budgets"]) and "padding" not in plain["lora"]
    assert bench.row_config(args, 0, "async@4x2+avgm0.9+e0.1", None)["server_opt"] == \
        {"name": "fedavgm", "momentum": 0.9, "lr": 0.1}
    assert bench.row_config(args, 0, "async@4x2+adam0.01", None)["server_opt"] == {"name": "fedadam", "lr": 0.01}
    assert "server_opt" not in bench.row_config(args, 0, "async@4x2", None)
    for bad in ("planner@p30+fp8", "planner@p30+more", "async@4x2+e0.1", "async@4x2+avgm"):
        with pytest.raises(ValueError):
            bench.parse_variant(bad)
