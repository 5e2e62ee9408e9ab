"""Aggregation rules that wrap any strategy (:class:`Rule`), and the built-in ones, registered on
import: median, trimmed_mean, krum, multi_krum (``aggregation.rule``), clip
(``aggregation.clip_norm``), dp (``dp.enabled``), the LoRA rules fedex, flora, svd, fedsa
(``lora.aggregation``), lora_ranks (``lora.ranks``) and server_opt (``server_opt.name``:
FedAvgM, FedAdagrad, FedAdam, FedYogi) and secure_aggregation
(``privacy.secure_aggregation``)."""

from fedslice.fl.rules.base import Rule, describe_rules, find_rule, selected_rules, unwrap, wrap_rules
from fedslice.fl.rules.clip import Clip
from fedslice.fl.rules.dp import DPFedAvg
from fedslice.fl.rules.lora import SVD, FedEx, FedSA, FLoRA, LoraRanks, LoraRule
from fedslice.fl.rules.robust import Krum, Median, MultiKrum, TrimmedMean
from fedslice.fl.rules.secagg import SecureAggregation
from fedslice.fl.rules.server_opt import ServerOpt

__all__ = ["Clip", "DPFedAvg", "FLoRA", "FedEx", "FedSA", "Krum", "LoraRanks", "LoraRule",
           "Median", "MultiKrum", "Rule", "SVD", "SecureAggregation", "ServerOpt", "TrimmedMean",
           "describe_rules", "find_rule", "selected_rules", "unwrap", "wrap_rules"]
