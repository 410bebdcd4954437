"""Request processing around the engine core, off its thread: prompts in (tokenization, chat templates,
validation, LoRA files, grammar compiles), text out (detokenization, stop strings, deltas)."""
