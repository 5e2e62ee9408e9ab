"""HF peft wiring: LoRA with validated targets."""

from fedslice.peft.lora import apply_lora, lora_module_names, resolve_targets

__all__ = ["apply_lora", "lora_module_names", "resolve_targets"]
