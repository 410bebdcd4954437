"""The engine's Triton custom metrics (tritonserver's metrics port): names, help and what they come from.
The adapter reads some of them back (loaded LoRA adapters, the engine's load)."""

# EngineStats field → (metric name, help)
GAUGES = {
    "running": ("tritonllm:num_requests_running", "Requests with a sequence in the running batch"),
    "waiting": ("tritonllm:num_requests_waiting", "Requests waiting for admission (none of their sequences runs)"),
    "free_blocks": ("tritonllm:kv_cache_free_blocks", "Free blocks of the paged KV cache"),
    "total_blocks": ("tritonllm:kv_cache_total_blocks", "Blocks of the paged KV cache"),
    "kv_cache_usage": ("tritonllm:kv_cache_usage",
                       "Fraction of KV cache blocks held by sequences, 0 to 1 (cached prefixes kept for reuse count as free)"),
    "prefix_cache_hit_rate": ("tritonllm:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache"),
    # a constant, published for the adapter's /v1/models
    "max_model_len": ("tritonllm:max_model_len", "Most tokens (prompt + output) one request may hold"),
    # 1 once the engine gave up after consecutive failed steps (the adapter's /health then answers 503)
    "is_dead": ("tritonllm:engine_dead", "1 when the engine failed max_step_failures steps in a row and refuses work"),
}
COUNTERS = {
    "prompt_tokens": ("tritonllm:prompt_tokens_total", "Prompt tokens of admitted requests"),
    "generated_tokens": ("tritonllm:generation_tokens_total", "Generated tokens"),
    "preemptions": ("tritonllm:preemptions_total", "Sequences preempted to free KV blocks"),
}


LORA_LOADED = ("tritonllm:lora_adapter_loaded",
               "1 while the LoRA adapter (label adapter) holds a slot of the pool, 0 once evicted")

HISTOGRAMS = {
    "time_to_first_token": ("tritonllm:time_to_first_token_seconds", "Time from arrival to the first token",
                            [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    "inter_token": ("tritonllm:inter_token_latency_seconds", "Time between a request's consecutive outputs",
                    [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
}
