"""The functions the ``*_local.yaml`` tasks name (``!function local_data.NAME``)."""

from fedslice.harness_tasks import load  # noqa: F401
from lm_eval.tasks.truthfulqa.utils import process_results_mc2  # noqa: F401
