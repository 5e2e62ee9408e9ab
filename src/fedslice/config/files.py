"""Config files: reading TOML/YAML/JSON, ``--set`` overrides, variants, validation messages.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fedslice.errors import ConfigError
from fedslice.config.base import read_utf8


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per error: the dotted field (``method.sparsity``), the message, the value."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" (got {value!r})"
        lines.append(f"  {loc or '<root>'}: {msg}{shown}")
    return "\n".join(lines)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON file into a plain dict (no validation)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = read_utf8(path, "config file")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {path.suffix!r} "
                              "(use .toml, .yaml, .yml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, got {type(data).__name__}")
    return data


#: fields naming a file that belongs with the config (section, key): a relative path written in
#: a config file is relative to that file's folder; one given as an override (``--set``), to the
#: working directory, as a path typed in a shell is
CONFIG_FILE_FIELDS = (("budgets", "csv"), ("devices", "csv"), ("devices", "trace"))


def resolve_file_fields(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` with every relative path of :data:`CONFIG_FILE_FIELDS` made absolute against
    ``folder`` (a new dict; other values unchanged)."""
    data = json.loads(json.dumps(data))
    for section, key in CONFIG_FILE_FIELDS:
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str) and node[key].strip():
            path = Path(node[key]).expanduser()
            node[key] = str(path if path.is_absolute() else (folder / path).absolute())
    return data


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML literal (numbers, booleans, lists, quoted strings)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (returns a new dict)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def merge_variant(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A ``[[variants]]`` entry merged on the base config (nested tables merged key by key)."""
    out = json.loads(json.dumps(base))
    for k, v in top.items():
        # A variant's method replaces the base's: options of one method are unknown to another.
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "method":
            out[k] = merge_variant(out[k], v)
        else:
            out[k] = v
    return out
