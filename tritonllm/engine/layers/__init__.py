"""Layers the model forward passes are built from, over the kernels: paged attention, norms, rotary embeddings,
the mixture-of-experts MLP, projections in a weight format and LoRA application."""
