"""The built-in plug-ins: importing this module registers every built-in method, adapter and
aggregation rule (each package's ``__init__`` imports its modules, and each module registers
itself). Imported by :mod:`fedslice.experiment` (loading configs) and by nothing below it."""

import fedslice.fl.rules  # noqa: F401  (mean/median/trimmed_mean/krum/multi_krum, clip, dp)
import fedslice.methods  # noqa: F401  (fedavg, fedpetuning, raffm, heads, fedpft, fedot)
import fedslice.peft  # noqa: F401  (lora, none)

BUILTIN_PACKAGES = ("fedslice.fl.rules", "fedslice.methods", "fedslice.peft")
