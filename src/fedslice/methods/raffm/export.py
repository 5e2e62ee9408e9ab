"""An elastic sub-model (RaFFM) as a smaller standalone transformers checkpoint: raffm's
export hook (:class:`fedslice.registry.ElasticExport`), which ``fedslice export --size`` asks
through the method registry.

The sub-model keeps ``k`` of ``H`` heads and ``f`` of ``F`` FFN neurons in every kept layer (the
planner's leading slices are uniform). Its config says so where the stock config can: layer
counts and FFN widths everywhere; heads where the head size is a config field of its own
(LLaMA's ``head_dim``, T5's ``d_kv``). Elsewhere the head size is ``hidden / heads``, so the
config keeps ``H`` and gains ``fedslice_elastic`` (kept heads, head size, projection paths);
the folder's ``fedslice_elastic.py`` (stock transformers + torch) builds the model and narrows
those projections before the weights load: ``trust_remote_code=True``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch.nn as nn

from fedslice.errors import ConfigError, FedsliceError
from fedslice.methods.raffm.method import ELASTIC
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import AUTO_CLASSES
from fedslice.slicing.spec import Spec, spec_from_dict, stack_specs
from fedslice.slicing.surgery import extract_model

MODULE = "fedslice_elastic"

_CODE = '''"""A fedslice elastic sub-model: a stock transformers model whose attention keeps
fewer heads than hidden_size / num_attention_heads (config.fedslice_elastic says which
projections are narrower). Written by `fedslice export --size`; needs transformers and torch."""

import torch.nn as nn
import transformers
from transformers.pytorch_utils import Conv1D


def _get(root, path):
    for name in path.split("."):
        root = root[int(name)] if name.isdigit() else getattr(root, name)
    return root


def _put(root, path, module):
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, module)


def _narrow(old, out=None, inp=None, conv1d=False):
    """A linear map like ``old`` with ``out`` outputs or ``inp`` inputs (weights load later)."""
    if conv1d:  # GPT-2's Conv1D: weight (in, out)
        n_in, n_out = old.weight.shape
        return Conv1D(out or n_out, inp or n_in)
    return nn.Linear(inp or old.in_features, out or old.out_features, bias=old.bias is not None)


def narrow_attention(model, spec):
    conv1d = spec["layout"] == "conv1d"
    for stack in spec["stacks"]:
        for block in _get(model, stack["layers"]):
            for att in stack["attention"]:
                for path in att["out"]:
                    _put(block, path, _narrow(_get(block, path), out=att["out_width"], conv1d=conv1d))
                _put(block, att["o"], _narrow(_get(block, att["o"]), inp=att["width"], conv1d=conv1d))
                module = _get(block, att["module"]) if att["module"] else block
                for name, value in att["attrs"].items():
                    setattr(module, name, value)


class {name}(transformers.{base}):
    def __init__(self, config):
        super().__init__(config)
        narrow_attention(self, config.fedslice_elastic)
'''


class ElasticSizes:
    """raffm's :class:`fedslice.registry.ElasticExport`: the sizes a finished run saved
    (``raffm_elastic.json``, written at its end), each cut as its own checkpoint."""

    def spec(self, run_dir: Path, size: float, finished: bool) -> Spec:
        """The saved sub-model spec of elastic size ``size``; a ConfigError listing valid sizes."""
        path = run_dir / ELASTIC
        if not path.is_file():
            why = ("the run did not finish: elastic sizes are saved at its end" if not finished
                   else f"no {ELASTIC} in the run folder")
            raise ConfigError(f"--size: {why}; export the whole model without --size")
        sizes = json.loads(path.read_text())["sizes"]
        valid = [e["size"] for e in sizes]
        match = [e for e in sizes if abs(e["size"] - size) < 1e-9]
        if not match:
            raise ConfigError(f"--size {size:g} is not an elastic size of this run: valid sizes are "
                              f"{', '.join(f'{v:g}' for v in valid)} (method.elastic_sizes)")
        return spec_from_dict(match[0]["spec"])

    def save(self, model: nn.Module, arch: ArchSpec, spec, dest: Path, head: str) -> None:
        save_elastic(model, arch, spec, dest, head)


def _uniform(values, what: str) -> int:
    values = set(values)
    if len(values) != 1:
        raise FedsliceError(f"--size: the sub-model keeps different {what} per layer {sorted(values)}: "
                            "not expressible as one transformers config")
    return values.pop()


def save_elastic(model: nn.Module, arch: ArchSpec, spec, dest: Path, head: str) -> None:
    """Save the sub-model of ``spec`` cut from the plain HF ``model`` into ``dest``."""
    sub = extract_model(model, spec, arch)
    config = copy.deepcopy(model.config)
    specs = stack_specs(spec, arch)
    narrow, heads_attr = [], {}
    for k, (stack, s) in enumerate(zip(arch.stacks, specs)):
        if s is None:
            continue
        dims = arch.dims(model.config, k)
        heads = _uniform([len(s.heads_of(j, f)) for j in range(len(s.layers))
                          for f in range(len(stack.attention))], "head counts")
        ffn = _uniform([len(n) for n in s.neurons], "FFN widths")
        setattr(config, stack.num_layers_attr, len(s.layers))
        setattr(config, stack.ffn_attr, ffn)
        if heads == dims["num_heads"]:
            continue
        if arch.head_dim_attr:  # the head size is its own field: fewer heads in the config
            if s.num_kv_heads:
                kv = _uniform([len(s.kv_heads(j)) for j in range(len(s.layers))], "key/value heads")
                if heads % kv or any(len(s.heads[j]) // kv * kv != len(s.heads[j]) for j in range(len(s.layers))):
                    raise FedsliceError("--size: kept query heads do not form whole key/value groups")
                setattr(config, arch.kv_heads_attr, kv)
            if heads_attr.setdefault(stack.num_heads_attr, heads) != heads:
                raise FedsliceError("--size: stacks keep different head counts under one config field")
            setattr(config, stack.num_heads_attr, heads)
            continue
        width = heads * dims["head_dim"]
        atts = []
        for att in stack.attention:
            outs = list(dict.fromkeys((att.q, att.k, att.v)))
            attrs = {}
            if arch.heads_attr:
                attrs[arch.heads_attr] = heads
            if arch.heads_width_attr:
                attrs[arch.heads_width_attr] = width
            atts.append({"module": att.module, "out": outs, "o": att.o,
                         "out_width": width * (3 if att.fused_qkv else 1), "width": width,
                         "attrs": attrs})
        narrow.append({"layers": stack.layers, "attention": atts})
    if narrow:
        base = type(model).__name__
        name = f"Elastic{base}"
        config.fedslice_elastic = {"layout": arch.weight_layout, "stacks": narrow}
        config.auto_map = {AUTO_CLASSES[head]: f"{MODULE}.{name}"}
        (dest / f"{MODULE}.py").write_text(_CODE.replace("{name}", name).replace("{base}", base))
        from importlib import util
        spec_ = util.spec_from_file_location(MODULE, dest / f"{MODULE}.py")
        code = util.module_from_spec(spec_)
        spec_.loader.exec_module(code)
        cls = getattr(code, name)
    else:
        cls = type(model)
    small = cls(config)
    state = {k: v for k, v in sub.state_dict().items()}
    missing, unexpected = small.load_state_dict(state, strict=False)
    # tied weights (an LM head tied to the embeddings) are one tensor under two names
    missing = [k for k in missing if k not in _tied(small)]
    if missing or unexpected:
        raise FedsliceError(f"--size: the sub-model does not fit its config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    small.eval()
    small.save_pretrained(str(dest))
    if narrow:  # save_pretrained writes the config: keep the auto_map to our module
        cfg = json.loads((dest / "config.json").read_text())
        cfg["auto_map"] = config.auto_map
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))


def _tied(model: nn.Module) -> set[str]:
    seen, out = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
            out.add(seen[id(p)])
        seen.setdefault(id(p), name)
    return out
