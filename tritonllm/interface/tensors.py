"""The Triton tensor interface of model `llm` by name (tritonllm/model_repository/llm/config.pbtxt declares the same
tensors; a test checks they agree). Compatible with Triton's vllm_backend; its clients work unchanged."""

from enum import StrEnum

PROMPT_INPUTS = ("text_input", "input_ids", "messages")  # exactly one carries the prompt
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                "return_num_output_tokens", "return_num_cached_tokens", "return_matched_stop", "return_token_ids",
                "return_prompt_token_ids", "return_cached_tokens_details", "return_model_instance")
"""Each adds the output of its name without "return_". return_model_instance adds a first response of its own,
with only model_instance (the engine instance that took the request), sent as the engine takes it."""
CACHE_TIERS = ("device", "host", "storage")
"""The KV cache's tiers (tritonllm/engine/core/kv_tiers.py): the order of `cached_tokens_details`'s counts."""
STORAGE_BACKEND = "file"  # what the storage tier is, as SGLang's cached_tokens_details names it
PROMPT_OPTIONS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""How the prompt becomes tokens (vLLM's names): BOOL inputs, but chat_template_kwargs (a JSON object)."""
TOOL_INPUTS = ("tools", "tool_choice", "parallel_tool_calls")
"""messages: OpenAI's tools (a JSON list), tool_choice (none, auto, required, or a JSON object naming a function),
parallel_tool_calls (BOOL): see tritonllm/interface/tools.py."""
CANCEL_INPUT = "cancel_request_id"
"""A request with only this input cancels the request in flight with that Triton request id (it ends with a
cancelled error, its last response); its one response is CANCEL_OUTPUT. It lets a client end a request without
cancelling its gRPC stream: tritonserver 2.51's gRPC frontend can leak the state of a stream cancelled while a
response is written, and a leaked stream keeps the model loaded, so a later stop waits out the exit timeout."""
CANCEL_OUTPUT = "cancelled"  # BOOL [1]: whether that request was in flight on this instance
INPUTS = PROMPT_INPUTS + ("stream", "sampling_parameters", "exclude_input_in_output") + RETURN_FLAGS + \
    PROMPT_OPTIONS + TOOL_INPUTS + ("tokenize_only", CANCEL_INPUT)

OUTPUTS = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens",
           "num_cached_tokens", "matched_stop", "prompt_logprobs", "hidden_states", "prompt_hidden_states",
           "routed_experts", "token_ids", "prompt_token_ids", "prompt_token_strs", "max_model_len", "tool_calls",
           "reasoning_output", "num_reasoning_tokens", "cached_tokens_details", CANCEL_OUTPUT, "model_instance")
TOKENIZE_OUTPUTS = ("text_output", "prompt_token_ids", "prompt_token_strs", "num_input_tokens", "max_model_len")
"""The one response of a `tokenize_only` request: the prompt's text and tokens, nothing generated."""

RUNNING = "None"  # finish_reason of a choice still running: vllm_backend sends Python's str(None)


class FinishReason(StrEnum):
    """Every way a choice ends: the `finish_reason` output's values (and OpenAI's), and the labels of the finished
    requests' counter (vllm:request_success_total), which is made from this declaration."""

    STOP = "stop"  # a stop token, stop string or regex, or a complete grammar
    LENGTH = "length"  # max_tokens or the context
    TOOL_CALLS = "tool_calls"  # stopped after calling tools
    ABORT = "abort"  # cancelled: by the client, a stop string seen by the responder, or the shutdown
    ERROR = "error"  # the request failed in the engine (never sent: the request gets an error instead)

CHAT_ROLES = ("system", "user", "assistant", "tool")  # roles the `messages` input accepts


def chat_template_conflict(add_generation_prompt: bool, continue_final_message: bool) -> str | None:
    """vLLM's rule: the final message is either closed and answered or continued, not both (the error, if so)."""
    if add_generation_prompt and continue_final_message:
        return ("Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                "(add_generation_prompt defaults to true: set it to false to continue the final message).")
    return None


def message_text(content) -> str:
    """A chat message's content as the chat template gets it: a string, or OpenAI's list of content parts, whose
    text parts are concatenated. ValueError for anything else (the model reads text only)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(part, dict) for part in content):
        raise ValueError("content must be a string or a list of content parts")
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"content parts of type {part.get('type')!r} are not supported: this model reads text "
                             "only (parts of type 'text')")
        if not isinstance(part.get("text"), str):
            raise ValueError("a content part of type 'text' needs a string 'text'")
    return "".join(part["text"] for part in content)
