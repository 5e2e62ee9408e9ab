"""fedslice: federated fine-tuning of transformer foundation models on clients that cannot afford the whole model."""

__version__ = "0.1.0"
