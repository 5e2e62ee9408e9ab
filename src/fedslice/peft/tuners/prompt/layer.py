"""What prompt tuning holds: ``prompt_encoder.<adapter>.embedding.weight`` (P, d), the virtual
tokens' input embeddings. It has no per-head parameter: a virtual token's embedding feeds every
head of the first layer through q/k/v, and its columns are hidden features, not heads."""

#: the tensor's name under the PeftModel (peft's own, also P-tuning's and prefix tuning's table)
EMBEDDING = "prompt_encoder.{adapter}.embedding.weight"
