"""Layers the model forward passes are built from, over the kernels: paged attention and LoRA application."""
