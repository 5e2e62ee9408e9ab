"""One cold start of a simulation run, phase by phase (run by bench/startup.py in a fresh
process; prints one JSON line). Phases: interpreter + imports, data (read, tokenize, partition),
model load, method build, the first local training step (one client, one step)."""

import json
import sys
import time

import psutil

t_proc = psutil.Process().create_time()
marks = {"python": time.time() - t_proc}
t = time.perf_counter()
import fedslice.api as api  # noqa: E402
from fedslice.experiment import load_config  # noqa: E402
from fedslice.run.engine import client_seed  # noqa: E402
from fedslice.run.setup import prepare_data  # noqa: E402
from fedslice.methods import METHODS, build_method  # noqa: E402
from fedslice.models.arch import arch_for  # noqa: E402
from fedslice.models.loading import load_config as model_config, load_model  # noqa: E402
from fedslice.tasks import make_task  # noqa: E402
import torch  # noqa: E402

marks["import"] = time.perf_counter() - t
cfg = load_config(sys.argv[1], sys.argv[2:])
if cfg.threads:
    torch.set_num_threads(cfg.threads)
t = time.perf_counter()
arch = arch_for(model_config(cfg.model)[0])
task = make_task(cfg, arch)
raw = task.load_raw()
marks["data_read"] = time.perf_counter() - t
t = time.perf_counter()
loaded = load_model(cfg.model, task.num_labels(raw), cfg.seed, head=task.head)
marks["model"] = time.perf_counter() - t
t = time.perf_counter()
data = prepare_data(cfg, task, task.encode(raw, loaded))
marks["data_tokenize_partition"] = time.perf_counter() - t
t = time.perf_counter()
method = build_method(cfg, loaded, task)
state = method.initial_state()
payload = method.strategy.configure_train(1, state, [0])[0]
marks["method"] = time.perf_counter() - t
t = time.perf_counter()
payload.config["local_steps"] = 1
method.fit(payload, data.client(0), client_seed(cfg.seed, 1, 0))
marks["first_step"] = time.perf_counter() - t
marks["total"] = time.time() - t_proc
marks["modules"] = {m: m in sys.modules for m in ("flwr", "ray", "matplotlib", "datasets", "peft",
                                                   "transformers", "flwr_datasets", "opacus")}
print(json.dumps(marks))
