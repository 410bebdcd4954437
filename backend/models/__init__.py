"""Model forward passes written for the engine (flat token batches over a paged KV cache)."""
