"""What P-tuning holds, under ``prompt_encoder.<adapter>``: ``embedding.weight`` (P, d), the
virtual tokens' own embeddings, and the prompt encoder (``mlp_head.{0,2,4}``: d -> h -> h -> d
linears; or ``lstm_head`` + ``mlp_head``) that turns them into the input embeddings prepended to
every sequence. No per-head parameter: the encoder's outputs are hidden features."""
