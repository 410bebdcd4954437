"""Wire models of OpenAI's legacy completions API (plus the SGLang/vLLM extensions we accept)."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_serializer, model_validator

from openai_adapter.errors import from_validation_error, invalid_request

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
"""Triton's input_ids tensor is INT32."""

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]
"""One text, a batch of texts, one tokenized prompt, or a batch of tokenized prompts."""


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class NotYetSupportedParameters(BaseModel):
    """Known OpenAI/SGLang/vLLM parameters the engine does not implement yet.

    They are accepted so clients that send them at their neutral value keep working; any other value is
    refused (see `CompletionRequest.unsupported_parameter`) instead of being silently ignored.
    """

    best_of: int | None = 1
    suffix: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    lora_path: str | list[str | None] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    return_hidden_states: bool = False
    return_routed_experts: bool = False


class CompletionRequest(NotYetSupportedParameters):
    """Body of POST /v1/completions. Unknown fields are ignored (SDKs send extra_body fields as they are)."""

    model: str
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    """None: generate until a stop condition or the end of the context."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    """-1 turns top-k off."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_cached_tokens_details: bool = False
    """SGLang extension: add `sglext.cached_tokens_details` beside the usage."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    seed: int | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API treats an explicit null as "use the default"; clients such as LangChain send them."""
        if not isinstance(data, dict):
            return data
        return {
            name: value
            for name, value in data.items()
            if value is not None or name == "max_tokens" or cls._default_of(name) is None
        }

    @classmethod
    def _default_of(cls, name: str) -> Any:
        field = cls.model_fields.get(name)
        return None if field is None else field.default

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: Any) -> Prompt:
        # The union's own errors list every member type; one plain sentence is more useful.
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists "
                "(token ids are integers from 0 to 2**31 - 1)"
            ) from None
        if prompt == [] or (isinstance(prompt, list) and any(item == [] for item in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each one becomes its own Triton request."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else self.stop

    def unsupported_parameter(self) -> str | None:
        """The first not-yet-supported parameter set to something other than its neutral value."""
        for name, field in NotYetSupportedParameters.model_fields.items():
            value = getattr(self, name)
            if value != field.default and value not in ("", [], {}):
                return name
        return None


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Parse and validate a raw request body; every failure is a 400 naming the offending parameter."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"The request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CachedTokensDetails(BaseModel):
    """Where the prompt's cached tokens came from, per cache tier (SGLang's shape; only the device tier exists)."""

    device: int
    host: int = 0
    storage: int = 0
    storage_backend: str | None = None


class SglExt(BaseModel):
    cached_tokens_details: CachedTokensDetails


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (same object type, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    sglext: SglExt | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_extension(self, handler) -> dict:
        data = handler(self)
        if data.get("sglext") is None:
            data.pop("sglext", None)
        return data


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
