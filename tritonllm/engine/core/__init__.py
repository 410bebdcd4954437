"""The engine core on token ids: scheduler → model runner → sampler, driven by `EngineCore.step()` on the core thread."""
