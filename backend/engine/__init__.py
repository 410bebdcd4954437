"""The serving engine: scheduler → model runner → sampler → output processor, driven by `LLMEngine.step()`."""
