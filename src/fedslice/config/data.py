"""The ``[data]`` section: where the task's data lives, how its files are read, how it is split.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config.base import Section


class DataConfig(Section):
    """Where the task's data lives, how its files are read, and how it is split among clients."""

    path: str = Field("sst2", description="A folder with train/dev/test files (dev/test optional: "
                      "carved off train), one file (train alone, or all splits with "
                      "`split_column`), or a hub id such as 'glue/sst2'. 'sst2' resolves to "
                      "../shared/data/sst2 when present.")
    text_columns: list[str] | None = Field(None, min_length=1, max_length=2,
                                           description="One text column, or two for sentence "
                                           "pairs. Unset: 'sentence' if the data has it, else "
                                           "'text', else its single column besides the label "
                                           "(and split/group) columns; the log says which.")
    label_column: str = Field("label", description="Column of class labels: integer ids >= 0 "
                              "or names (mapped to ids in sorted order of the train split).")
    image_column: str = Field("image", description="Image tasks: the column holding each image "
                              "(CSV/JSONL: a path, relative to the data folder; hub datasets: the "
                              "image feature, e.g. 'img' for CIFAR-10). Image folders (one sub-folder "
                              "per class) and IDX files need no columns.")
    server_holdout: float = Field(0.0, ge=0, lt=0.5, description="Fraction of the train split the "
                                  "server keeps apart (seeded, before partitioning: no client gets "
                                  "it); method.distill.corpus = 'server_holdout' distils on it "
                                  "(FedPFT/FedOT on image tasks).")
    labels: list[str] | None = Field(None, min_length=2, description="Class names in id order: "
                                     "fixes the label ids (a label not listed is an error).")
    format: Literal["auto", "tsv", "csv", "jsonl", "parquet"] = Field(
        "auto", description="File format; 'auto': from the file extension.")
    header: bool = Field(True, description="TSV/CSV files start with a line naming the columns.")
    columns: list[str] | None = Field(None, min_length=1, description="Names of the fields of "
                                      "headerless TSV/CSV files (default: '0', '1', ...).")
    delimiter: str | None = Field(None, min_length=1, max_length=1, description="Field separator "
                                  "(default: tab for .tsv, comma for .csv).")
    quotes: bool | None = Field(None, description="Fields may be enclosed in double quotes "
                                "(default: true for CSV, false for TSV, whose sentences may hold "
                                "unbalanced quotes).")
    split_column: str | None = Field(None, description="Column saying each row's split "
                                     "(train, dev/validation, test) of a single file.")
    holdout_fraction: float = Field(0.1, gt=0, lt=0.5, description="Fraction of train carved "
                                    "off (seeded) for each missing dev/test split.")
    group_column: str | None = Field(None, description="Rows sharing a value of this column stay "
                                     "on the same side when dev/test are carved off train.")
    bad_rows: Literal["error", "skip"] = Field("error", description="A row with a missing or "
                                               "empty field: stop naming file and line, or skip "
                                               "it (counted in the log).")
    hub_subset: str | None = None
    max_length: int = Field(128, gt=0)
    max_train_examples: int | None = Field(None, gt=0, description="Seeded subset of train (quick runs).")
    max_dev_examples: int | None = Field(None, gt=0)
    max_test_examples: int | None = Field(None, gt=0)
    partition: Literal["iid", "dirichlet", "shards", "natural"] = Field(
        "iid", description="How train is split among clients: 'iid', 'dirichlet' (label skew, "
        "`alpha`), 'shards' (label shards), or 'natural': one client per distinct value of "
        "`client_column` (a user, a category), as Flower Datasets' NaturalIdPartitioner; "
        "federation.num_clients then comes from the data.")
    client_column: str | None = Field(None, description="partition = 'natural': the column "
                                      "naming each row's client (e.g. 'user').")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (label skew).")
    shards_per_client: int = Field(2, gt=0)
    min_partition_size: int = Field(0, ge=0, description="Fewest rows per client: dirichlet "
                                    "redraws, iid/shards refuse; 'natural' leaves out the clients "
                                    "with fewer rows (counted in the partition report).")

    @model_validator(mode="before")
    @classmethod
    def _indices_to_names(cls, data):
        """Columns may be given by index (0 = the first field): with `columns`, an index is its
        name there; without, headerless files name their fields '0', '1', ..."""
        if not isinstance(data, dict):
            return data
        names = data.get("columns")
        names = names if isinstance(names, list) else None

        def name(x):
            if isinstance(x, int) and not isinstance(x, bool):
                return names[x] if names is not None and 0 <= x < len(names) else str(x)
            return x

        data = dict(data)
        if isinstance(data.get("text_columns"), list):
            data["text_columns"] = [name(x) for x in data["text_columns"]]
        for key in ("label_column", "image_column", "split_column", "group_column", "client_column"):
            if key in data:
                data[key] = name(data[key])
        return data

    @field_validator("columns", "labels")
    @classmethod
    def _unique(cls, v):
        if v is not None:
            seen = [x for i, x in enumerate(v) if x in v[:i]]
            if seen:
                raise ValueError(f"names must be unique; repeated: {sorted(set(seen))}")
        return v

    @model_validator(mode="after")
    def _check_columns(self) -> "DataConfig":
        if (self.partition == "natural") != (self.client_column is not None):
            raise ValueError("partition = 'natural' and client_column go together: give the "
                             "column naming each row's client (e.g. client_column = 'user')"
                             if self.client_column is None else "client_column is for "
                             "partition = 'natural'")
        if self.columns is not None and self.header:
            raise ValueError("`columns` names the fields of headerless files: set header = false "
                             "(files with a header line are read by their own column names)")
        return self

    def check_columns(self, inputs: list[str]) -> None:
        """With ``columns`` (headerless files): every column the task reads (``inputs``: its
        text or image columns) and the label/split/group columns must be among them."""
        if self.columns is not None:
            named = [*inputs, self.label_column]
            named += [c for c in (self.split_column, self.group_column, self.client_column)
                      if c is not None]
            missing = [c for c in named if c not in self.columns]
            if missing:
                raise ValueError(f"column(s) {missing} are not among columns = {self.columns}")
