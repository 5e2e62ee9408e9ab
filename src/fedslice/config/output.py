"""The ``[evaluation]`` and ``[output]`` sections.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config.base import Section


class EvaluationConfig(Section):
    every: int = Field(1, gt=0, description="Evaluate on dev every E rounds (and after the last).")
    batch_size: int = Field(128, gt=0)
    target_accuracy: float = Field(0.8, gt=0, le=1, description="Dev accuracy counted as reached "
                                   "(rounds_to_target) for classification.")
    target: float | None = Field(None, description="The same for a generation task's primary "
                                 "metric (ROUGE-L, 0-100); none by default.")
    dev_generations: int | None = Field(100, gt=0, description="Generation tasks: dev BLEU/ROUGE "
                                        "on at most this many distinct prompts (seeded; dev loss "
                                        "uses every row). Test always uses every prompt.")
    track_test: bool = Field(False, description="Also evaluate on test at each evaluation round "
                             "(for accuracy-per-round curves; the final test result is always kept).")


class OutputConfig(Section):
    dir: str = "runs"
    name: str | None = None
    save_weights: bool = True
    plots: bool = Field(True, description="PNG plots and the self-contained report.html in the "
                        "run folder at its end (docs/results.md).")
    progress: bool = True
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers that get the config, one scalar "
        "per metric per round and the summary (docs/trackers.md); needs "
        "`pip install 'fedslice[trackers]'`.")
    checkpoint_every: int = Field(1, ge=0, description="Write a checkpoint (global and server "
                                  "state, RNGs, metrics) into the run folder every N rounds, "
                                  "kill-safe; `fedslice run --resume RUN_DIR` continues a run that "
                                  "failed or was stopped. 0: never (a failed run keeps its metrics "
                                  "and latest weights, but cannot be resumed).")
