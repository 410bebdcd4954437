"""Model forward passes written for the engine (flat token batches over a paged KV cache), one file per
architecture; registry.py picks the class a checkpoint's config.json names."""
