"""Knowledge distillation for proxy / emulator construction: corpus, losses, loop, APoZ, cache."""

from fedslice.distill.loop import DistillLog, distill
from fedslice.distill.losses import hidden_loss, layer_kd_loss, weight_loss

__all__ = ["DistillLog", "distill", "hidden_loss", "layer_kd_loss", "weight_loss"]
