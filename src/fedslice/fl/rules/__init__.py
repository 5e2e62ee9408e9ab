"""Aggregation rules that wrap any strategy (:class:`Rule`), and the built-in ones, registered on
import: median, trimmed_mean, krum, multi_krum (``aggregation.rule``), clip
(``aggregation.clip_norm``), dp (``dp.enabled``)."""

from fedslice.fl.rules.base import Rule, find_rule, selected_rules, unwrap, wrap_rules
from fedslice.fl.rules.clip import Clip
from fedslice.fl.rules.dp import DPFedAvg
from fedslice.fl.rules.robust import Krum, Median, MultiKrum, TrimmedMean

__all__ = ["Clip", "DPFedAvg", "Krum", "Median", "MultiKrum", "Rule", "TrimmedMean",
           "find_rule", "selected_rules", "unwrap", "wrap_rules"]
