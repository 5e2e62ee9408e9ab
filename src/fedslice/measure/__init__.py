"""Measured and analytic costs of a client's local training: communication (:mod:`.sizes`:
bytes and parameters sent down and up), compute (:mod:`.flops`: FLOPs counted on a real step,
and the analytic estimate to check them against), memory (:mod:`.memory`: peak RSS and saved
activations) and time; :class:`ClientCost` (:mod:`.cost`) bundles one client's numbers for one
round."""

from fedslice.measure.cost import ClientCost
from fedslice.measure.flops import (FlopCount, analytic_train_flops, bottom_skips, count_flops,
                                    embeddings_train, frozen_bottom, linear_param_counts, measure_step_flops)
from fedslice.measure.memory import LargestBatches, PeakMemory
from fedslice.measure.sizes import module_bytes, num_params, tensor_bytes, trainable_state_bytes

__all__ = ["ClientCost", "FlopCount", "LargestBatches", "PeakMemory", "analytic_train_flops", "bottom_skips",
           "count_flops", "embeddings_train", "frozen_bottom", "linear_param_counts", "measure_step_flops",
           "module_bytes", "num_params", "tensor_bytes", "trainable_state_bytes"]
