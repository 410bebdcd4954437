"""The engine's Triton custom metrics (tritonserver's metrics port): names, help and what they come from.
The adapter relays them on its /metrics and reads some back (loaded LoRA adapters, the engine's load). The
per-request ones carry vLLM's names, as they mean what vLLM's do."""

from tritonllm.interface.tensors import FinishReason

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
    "preemptions": ("tritonllm:preemptions_total", "Sequences preempted (recomputed later) to free KV blocks or for requests of higher priority"),
}


# EngineStats.prefix_cache_hits, a counter per tier label (tensors.CACHE_TIERS)
PREFIX_CACHE_HITS = ("tritonllm:prefix_cache_hits_total",
                     "Prompt tokens served from the prefix cache, by the KV cache tier they came from (label tier)")

LORA_LOADED = ("tritonllm:lora_adapter_loaded",
               "1 while the LoRA adapter (label adapter) holds a slot of the pool, 0 once evicted")

# vLLM's request-latency buckets, with finer ones below 0.3 s (small models, CPU queues)
_REQUEST_SECONDS = [0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKENS = [mantissa * 10 ** exponent for exponent in range(7) for mantissa in (1, 2, 5)]  # vLLM's 1-2-5 steps

# key → (metric name, help, buckets); observed by the responder (triton_metrics.RequestTracker)
HISTOGRAMS = {
    "time_to_first_token": ("tritonllm:time_to_first_token_seconds", "Time from arrival to the first token",
                            [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
    "inter_token": ("tritonllm:inter_token_latency_seconds", "Time between a request's consecutive outputs",
                    [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
    # once per finished request (cancelled and failed ones included; not those refused before the core took them)
    "e2e": ("vllm:e2e_request_latency_seconds", "Time from arrival to the last response", _REQUEST_SECONDS),
    "queue": ("vllm:request_queue_time_seconds", "Time in the engine's waiting queue before first scheduled",
              _REQUEST_SECONDS),
    "prefill": ("vllm:request_prefill_time_seconds", "Time from first scheduled to the first token",
                _REQUEST_SECONDS),
    "decode": ("vllm:request_decode_time_seconds", "Time from the first token to the last", _REQUEST_SECONDS),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Prompt tokens of a request", _TOKENS),
    "generation_tokens": ("vllm:request_generation_tokens", "Tokens generated for a request (all its choices)",
                          _TOKENS),
}

FINISHED = ("vllm:request_success_total", "Finished choices by finished_reason (a request of n choices counts n)")
FINISH_REASONS = tuple(FinishReason)  # every reason exported from the start (at 0)

INTERNAL_ERRORS = ("tritonllm:internal_errors_total",
                   "Failures of the engine's background work (label where: e.g. responder, metrics) that it survived; "
                   "the log has the first traceback of each and a count of the rest")

ALL_NAMES = frozenset([name for name, _ in (*GAUGES.values(), *COUNTERS.values(), PREFIX_CACHE_HITS, LORA_LOADED,
                                            FINISHED, INTERNAL_ERRORS)] +
                      [name for name, _, _ in HISTOGRAMS.values()])
"""Every metric family the engine exports (what the adapter relays, and what dashboards may query)."""
