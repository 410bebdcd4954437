"""Wire models of OpenAI's completions and chat completions APIs (plus the SGLang/vLLM extensions we accept).

The models say what shape a body has; the values of the sampling parameters are checked by their one
declaration (tritonllm/interface/parameters.py), which the engine uses too (see `CompletionService`)."""

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from tritonllm.interface.parameters import CONSTRAINTS, MAX_TOKEN_ID, PARAMETERS, Parameter
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.tensors import CHAT_ROLES, chat_template_conflict, message_text
from tritonllm.interface.tools import parse_tool_choice, parse_tools, template_message
from tritonllm.adapter.errors import from_validation_error, invalid_request

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
"""Triton's input_ids tensor is INT32."""


def engine_field(name: str, default: Any = dataclasses.MISSING) -> Any:
    """A field for the engine's sampling parameter `name`: its declared default (unless given) and, for the OpenAPI
    description only, its documented range; the values are checked by the declaration itself."""
    parameter = PARAMETERS[name]
    limits = {key: value for key, value in (("minimum", parameter.minimum), ("maximum", parameter.maximum))
              if value is not None and parameter.special is None}
    if parameter.exclusive_minimum and "minimum" in limits:
        limits["exclusiveMinimum"] = limits.pop("minimum")
    return Field(parameter.default if default is dataclasses.MISSING else default, description=parameter.doc,
                 json_schema_extra=limits or None)


SPELLED_OTHERWISE = ("logprobs", "prompt_logprobs", *CONSTRAINTS, "lora_path", "return_prompt_hidden_states")
"""The engine parameters a request spells its own way (completions.engine_parameters turns them into the engine's):
chat's logprobs is a flag beside top_logprobs, echo may need prompt logprobs, the constraints come from
StructuredOutputParameters, lora_path may name one adapter per prompt, and echo with return_hidden_states asks for
the prompt's hidden states. Every other engine parameter is a request field of its own name, made below from its
declaration, so the adapter cannot forget one."""

_API_TYPES = {"int": int, "float": float, "bool": bool, "string": str, "json": str | dict[str, Any],
              "strings": str | list[str], "token_ids": list[int], "logit_bias": dict[str, float]}
"""What a request may send for a parameter of each kind (the declaration then casts and checks it)."""


def _api_type(parameter: Parameter) -> Any:
    api_type = _API_TYPES[parameter.kind]
    return api_type | None if parameter.nullable else api_type


EngineParameters = create_model(
    "EngineParameters",
    __doc__="The engine's sampling parameters that a request sends under their own names (see SPELLED_OTHERWISE).",
    **{name: (_api_type(parameter), engine_field(name))
       for name, parameter in PARAMETERS.items() if name not in SPELLED_OTHERWISE},
)

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]
"""One text, a batch of texts, one tokenized prompt, or a batch of tokenized prompts."""


class NullMeansDefault(BaseModel):
    """OpenAI's API treats an explicit null as "use the default"; clients such as LangChain send them. Only the
    fields named in NULL_IS_A_VALUE, and those whose default is null, keep a null."""

    NULL_IS_A_VALUE: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            name: value
            for name, value in data.items()
            if value is not None or name in cls.NULL_IS_A_VALUE or cls._default_of(name) is None
        }

    @classmethod
    def _default_of(cls, name: str) -> Any:
        field = cls.model_fields.get(name)
        return None if field is None else field.default


class _WithExtensions(BaseModel):
    """An object with SGLang / vLLM extension fields, which appear only when the request asked for them."""

    EXTENSIONS: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_absent_extensions(self, handler) -> dict:
        data = handler(self)
        for name in self.EXTENSIONS:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class StreamOptions(NullMeansDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class NotYetSupportedParameters(BaseModel):
    """Known OpenAI/SGLang/vLLM parameters the engine does not implement yet.

    They are accepted so clients that send them at their neutral value keep working; any other value is
    refused (see `CompletionRequest.unsupported_parameter`) instead of being silently ignored.
    """

    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's newer spelling of the guided_* constraints
    guided_whitespace_pattern: str | None = None
    logits_processors: list[Any] | None = None
    custom_logit_processor: str | None = None  # SGLang's


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` of OpenAI's API."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Accepted for compatibility: the schema is always enforced."""


class StructuralTagStructure(BaseModel):
    """One structure of SGLang's `structural_tag` response format."""

    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # SGLang's structural_tag, its legacy form or xgrammar's `format` tree: the engine checks them
    structures: list[StructuralTagStructure] | None = None
    triggers: list[str] | None = None
    at_least_one: bool | None = None
    format: Any = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        if self.type == "structural_tag" and self.format is None and (self.structures is None or self.triggers is None):
            raise ValueError("type 'structural_tag' needs structures and triggers (SGLang's form) or a format "
                             "(xgrammar's)")
        return self

    def structural_tag(self) -> dict[str, Any]:
        """The engine's structural_tag (SGLang's sampling parameter: the response format itself)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude={"json_schema"})


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint: the parameter that set it, and what the engine gets."""

    param: str
    engine_field: str
    """The engine's sampling parameter: json_schema, regex, ebnf (a Lark or GBNF grammar) or structural_tag."""
    text: str


class StructuredOutputParameters(BaseModel):
    """Ways to constrain the output; a request may use one of them. OpenAI's `response_format`, SGLang's
    `json_schema` (a JSON string), `regex` and `ebnf`, and vLLM's `guided_*` names."""

    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The request's constraint; a 400 when it sets more than one."""
        found = self._constraints()
        if len(found) > 1:
            names = ", ".join(constraint.param for constraint in found)
            raise invalid_request(f"Only one of response_format, json_schema, regex, ebnf and guided_* may constrain "
                                  f"the output; this request sets {names}.", found[1].param)
        return found[0] if found else None

    def _constraints(self) -> list[Constraint]:
        found: list[Constraint] = []

        def add(param: str, engine_field: str, text: str | dict[str, Any] | None) -> None:
            if text is not None and text != "":  # as the engine: an empty string constrains nothing
                found.append(Constraint(param, engine_field, text if isinstance(text, str) else json.dumps(text)))

        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            add("response_format", "json_schema", {"type": "object"})
        if response_format is not None and response_format.type == "json_schema":
            add("response_format", "json_schema", response_format.json_schema.schema_)
        if response_format is not None and response_format.type == "structural_tag":
            add("response_format", "structural_tag", response_format.structural_tag())
        add("json_schema", "json_schema", self.json_schema)
        add("regex", "regex", self.regex)
        add("ebnf", "ebnf", self.ebnf)
        add("guided_json", "json_schema", self.guided_json)
        add("guided_regex", "regex", self.guided_regex)
        if self.guided_choice is not None:  # a Lark grammar of quoted alternatives (JSON strings are Lark strings)
            add("guided_choice", "ebnf", "start: " + " | ".join(map(json.dumps, self.guided_choice)))
        add("guided_grammar", "ebnf", self.guided_grammar)
        return found


class IgnoredParameters(BaseModel):
    """Fields that clients written for other servers send and that mean nothing here: accepted (their type
    checked) and ignored. Any other unknown field is a 400 naming it, as in OpenAI's API, so a misspelt or
    unimplemented parameter is never dropped silently."""

    user: str | None = None  # OpenAI's end-user id for abuse monitoring (openai SDK `user=`, LangChain, LiteLLM)
    safety_identifier: str | None = None  # OpenAI's newer name for `user`
    metadata: dict[str, str] | None = None  # OpenAI's tags of a stored completion (sent beside `store`)
    store: bool | None = None  # OpenAI's stored completions (LangChain's ChatOpenAI `store`)
    service_tier: str | None = None  # OpenAI's processing tier (LangChain's ChatOpenAI `service_tier`)
    prompt_cache_key: str | None = None  # OpenAI's prompt-cache routing hint (openai-agents, Codex CLI); the
    # prefix cache here needs none


class IgnoredVllmParameters(BaseModel):
    """vLLM-only fields that clients written for older vLLM still send and that vLLM itself tolerates: accepted (their
    type checked) and ignored, but named in a warning (`SamplingRequest.ignored_vllm_parameters`), since a client
    that sends one may expect it to do something."""

    guided_decoding_backend: str | None = None  # vLLM 0.x's grammar backend per request: this server has one
    mm_processor_kwargs: dict[str, Any] | None = None  # arguments of a multimodal model's processor: text-only here


class SamplingRequest(NotYetSupportedParameters, StructuredOutputParameters, EngineParameters, IgnoredParameters,
                      IgnoredVllmParameters, NullMeansDefault):
    """What completion and chat requests share: the model, the engine's sampling parameters, streaming."""

    model_config = ConfigDict(extra="forbid")
    NULL_IS_A_VALUE: ClassVar[tuple[str, ...]] = ("max_tokens",)  # null max_tokens: up to the context's end

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_cached_tokens_details: bool = False
    """SGLang extension: add `sglext.cached_tokens_details` beside the usage."""
    lora_path: str | list[str | None] | None = None
    """SGLang extension: the LoRA adapter (its name or a path inside the server's adapters directory), or one
    per prompt (null: the base model). `model: "<served model>:<adapter>"` says the same."""
    return_token_ids: bool = False
    """vLLM extension: each choice's `token_ids` (streamed: each chunk's new ones) and the prompt's
    `prompt_token_ids` (streamed: in the first chunk)."""
    return_tokens_as_token_ids: bool = False
    """vLLM extension: logprobs name each token `token_id:<id>` instead of its text (texts that are not whole
    characters stay identifiable)."""

    def api_name(self, engine_field: str | None) -> str | None:
        """This request's name for an engine sampling parameter."""
        return engine_field

    def unsupported_parameter(self) -> str | None:
        """The first not-yet-supported parameter set to something other than its neutral value."""
        return self._first_non_neutral(NotYetSupportedParameters)

    def ignored_vllm_parameters(self) -> list[str]:
        """The vLLM-only fields this request sets, which it will not get."""
        return [name for name in IgnoredVllmParameters.model_fields if getattr(self, name) is not None]

    def _first_non_neutral(self, group: type[BaseModel]) -> str | None:
        for name, field in group.model_fields.items():
            value = getattr(self, name)
            if value != field.default and value not in ("", [], {}):
                return name
        return None


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions."""

    prompt: Prompt
    add_special_tokens: bool = True
    """vLLM extension: false tokenizes text prompts without the tokenizer's special tokens (BOS)."""
    suffix: str | None = None
    """Only empty: the served model has no fill-in-the-middle support (checked by the service)."""
    echo: bool = False
    logprobs: int | None = engine_field("logprobs")
    prompt_logprobs: int | None = engine_field("prompt_logprobs")
    """vLLM extension: each choice's `prompt_logprobs`, with this many alternatives per prompt token."""

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

    def has_token_id_prompts(self) -> bool:
        """Whether the prompts are token ids (a batch is all text or all token ids)."""
        return isinstance(self.prompts()[0], list)

    def engine_logprobs(self) -> int | None:
        """The engine's `logprobs` (top candidates per token); None: no logprobs."""
        return self.logprobs

    echoes_prompt: ClassVar[bool] = True  # echo puts the prompt (its tokens, with logprobs) first

    def prompt_options(self) -> dict[str, bool]:
        return {} if self.add_special_tokens else {"add_special_tokens": False}

    def echoed_text(self, prompt: str) -> str:
        return prompt


ChatRole = Literal[CHAT_ROLES]
"""The roles the engine accepts in its `messages` input."""


class ChatMessage(BaseModel):
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    """A string, or OpenAI's list of content parts: their texts are concatenated (other part types are 400); only
    an assistant message with tool_calls may leave it out."""
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls: OpenAI's {id, type: function, function: {name, arguments (a JSON string)}}."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""

    @field_validator("content")
    @classmethod
    def _text_of_parts(cls, content: str | list[dict[str, Any]] | None) -> str | None:
        return None if content is None else message_text(content)

    def check(self, index: int) -> None:
        """The engine's rules of a message (tritonllm/interface/tools.py)."""
        template_message(self.model_dump(exclude_none=True), index, message_text)


class NotYetSupportedChatParameters(BaseModel):
    """Chat parameters the engine does not implement yet; refused unless neutral, like NotYetSupportedParameters."""

    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated spelling of tools
    function_call: str | dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's own template per request: the engine renders the model's
    prompt_logprobs: int | None = None  # vLLM's; the completions API has it


class ChatMessages(BaseModel):
    """A conversation, which the engine renders with the model's chat template, and vLLM's controls of the
    rendering."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    """End the rendered conversation with the assistant's turn opened."""
    continue_final_message: bool = False
    """Leave the final message open for the model to continue it ("prefill"); needs add_generation_prompt false."""
    add_special_tokens: bool = False
    """Add the tokenizer's special tokens (BOS) on top of what the chat template puts in."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. a model's `enable_thinking`)."""

    @field_validator("continue_final_message")
    @classmethod
    def _check_continue_final_message(cls, continue_final_message: bool, info: ValidationInfo) -> bool:
        conflict = chat_template_conflict(info.data.get("add_generation_prompt", True), continue_final_message)
        if conflict:
            raise ValueError(conflict)
        return continue_final_message

    def prompt_options(self) -> dict[str, bool | str]:
        """The engine's PROMPT_OPTIONS inputs for the conversation."""
        options: dict[str, bool | str] = {"add_generation_prompt": self.add_generation_prompt,
                                          "continue_final_message": self.continue_final_message,
                                          "add_special_tokens": self.add_special_tokens}
        if self.chat_template_kwargs:
            options["chat_template_kwargs"] = json.dumps(self.chat_template_kwargs)
        return options

    def response_role(self) -> str:
        """vLLM's role of the answer: the assistant's after a generation prompt, else the final message's (which
        is continued)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @field_validator("messages", mode="wrap")
    @classmethod
    def _check_messages(cls, value: Any, handler: Any) -> list[ChatMessage]:
        try:
            messages = handler(value)
        except ValidationError as error:
            first = error.errors()[0]
            where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"])
            raise ValueError(
                f"messages{where}: {first['msg']} (messages must be a list of objects with a role in "
                f"{', '.join(CHAT_ROLES)} and a string content or a list of text content parts)"
            ) from None
        if not messages:
            raise ValueError("messages must not be empty")
        for index, message in enumerate(messages):
            message.check(index)
        return messages

    def conversation(self) -> list[dict]:
        """The messages as the engine's `messages` input takes them."""
        return [message.model_dump(exclude_none=True) for message in self.messages]


class ToolParameters(BaseModel):
    """Tool calling (tritonllm/interface/tools.py has the rules; the engine constrains and parses the calls)."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """none, auto (the default with tools), required, or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool = True
    """Whether one answer may hold several calls (auto, required)."""

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return None if tools is None else _checked(parse_tools, tools)

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, tool_choice: str | dict[str, Any] | None,
                           info: ValidationInfo) -> str | dict[str, Any] | None:
        if "tools" in info.data:  # (else tools failed already)
            _checked(parse_tool_choice, tool_choice, info.data["tools"])
        return tool_choice

    def tool_inputs(self) -> dict[str, bool | str]:
        """The engine's TOOL_INPUTS (tritonllm/interface/tensors.py)."""
        if self.tools is None:
            return {}
        inputs: dict[str, bool | str] = {"tools": json.dumps(self.tools),
                                         "parallel_tool_calls": self.parallel_tool_calls}
        if self.tool_choice is not None:
            inputs["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) \
                else json.dumps(self.tool_choice)
        return inputs


def _checked(rule, *arguments):
    """An interface rule's InvalidRequest as a validation error of the field."""
    try:
        return rule(*arguments)
    except InvalidRequest as error:
        raise ValueError(error.message) from None


class ChatCompletionRequest(SamplingRequest, ChatMessages, ToolParameters, NotYetSupportedChatParameters):
    """Body of POST /v1/chat/completions. The engine renders the messages with the model's chat template."""

    max_tokens: int | None = engine_field("max_tokens", None)
    """Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are given."""
    max_completion_tokens: int | None = engine_field("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = engine_field("logprobs")
    echo: bool = False
    """vLLM extension: the answer starts with the final message's content when the answer continues that
    message's role (see response_role)."""
    # Completion-only features, fixed off so the completion service can run chat requests unchanged.
    suffix: ClassVar[None] = None
    echoes_prompt: ClassVar[bool] = False  # chat's echo repeats a message, not the prompt's tokens

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top_logprobs

    @model_validator(mode="after")
    def _fold_max_completion_tokens(self) -> "ChatCompletionRequest":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def api_name(self, engine_field: str | None) -> str | None:
        if engine_field == "logprobs":
            return "top_logprobs"
        if engine_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return engine_field

    def prompt_options(self) -> dict[str, bool | str]:
        return super().prompt_options() | self.tool_inputs()

    def prompts(self) -> list[list[dict]]:
        """One prompt: the conversation, which the engine renders."""
        return [self.conversation()]

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def echoed_text(self, prompt: list[dict]) -> str:
        final = self.messages[-1]
        return final.content if final.role == self.response_role() else ""

    def unsupported_parameter(self) -> str | None:
        return super().unsupported_parameter() or self._first_non_neutral(NotYetSupportedChatParameters)


GenerationRequest = CompletionRequest | ChatCompletionRequest
"""What the completion service runs."""


class TokenizeCompletionRequest(BaseModel):
    """Body of POST /tokenize with a text prompt (vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """False: without the tokenizer's special tokens (BOS)."""
    return_token_strs: bool = False
    """Also return each token's string (the tokenizer's own, e.g. "Ġthe")."""

    def prompt_options(self) -> dict[str, bool]:
        return {"add_special_tokens": self.add_special_tokens}


class TokenizeChatRequest(ChatMessages, ToolParameters):
    """Body of POST /tokenize with chat messages (vLLM's): the rendered conversation's tokens (tools included)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    return_token_strs: bool = False

    def prompt_options(self) -> dict[str, bool | str]:
        return super().prompt_options() | self.tool_inputs()


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(_WithExtensions):
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("token_strs",)

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize (vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]


class LoadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/load_lora_adapter (vLLM's)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: NonEmptyStr
    """The name requests give as `model` (or `lora_path`)."""
    lora_path: NonEmptyStr
    """The adapter's directory: inside the adapters directory (relative to it or absolute)."""


class UnloadLoraAdapterRequest(BaseModel):
    """Body of POST /v1/unload_lora_adapter (vLLM's; adapters have no integer ids here)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: NonEmptyStr


def _json_object(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise invalid_request(f"The request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    return data


def _validated(data: dict, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """Parse and validate a raw request body as `model`; every failure is a 400 naming the offending parameter."""
    return _validated(_json_object(body), model)


def parse_by_shape(body: bytes, chat_model: type[ChatMessages], text_model: type[BaseModel]) -> Any:
    """A body that holds `messages` as `chat_model`, any other as `text_model` (vLLM's /tokenize and
    /invocations tell them apart so)."""
    data = _json_object(body)
    return _validated(data, chat_model if "messages" in data else text_model)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class _WithHiddenStates(_WithExtensions):
    """A choice's `hidden_states` (SGLang's) and `token_ids` (vLLM's)."""

    EXTENSIONS: ClassVar[tuple[str, ...]] = ("hidden_states", "token_ids")

    hidden_states: list[list[float]] | None = None
    token_ids: list[int] | None = None
    """vLLM extension (return_token_ids): the choice's token ids (a stream chunk: its new ones)."""


class Logprob(BaseModel):
    """vLLM's logprob of one token."""

    logprob: float | None
    rank: int | None
    decoded_token: str


class CompletionChoice(_WithHiddenStates):
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("hidden_states", "token_ids", "prompt_token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, Logprob] | None] | None = None
    """vLLM extension: per prompt token (null for the first, which nothing predicts) token id → its logprob, the
    token first, then the `prompt_logprobs` most likely alternatives; null when not asked for (and left out of
    stream chunks, which carry none)."""
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    """SGLang extension: the stop string (or the stop_regex pattern that matched) or the stop token id (EOS included)
    that ended the choice; null while it runs or when it ended otherwise (e.g. by length)."""
    prompt_token_ids: list[int] | None = None
    """vLLM extension (return_token_ids): the prompt's token ids (streamed: in the choice's first chunk)."""
    routed_experts: list[list[list[int]]] | None = Field(None, exclude=True)
    """The choice's [MoE layers][top_k] expert ids per token, when requested: the response carries them in
    `sglext.routed_experts`, not in the choice."""
    tool_calls: list[dict] | None = Field(None, exclude=True)
    """Chat with tools: the choice's tool calls (a stream chunk: their deltas), for chat.py to reshape."""
    reasoning_content: str | None = Field(None, exclude=True)
    """A reasoning model's chat: the choice's reasoning (a stream chunk: its new text), for chat.py."""


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None
    """A reasoning model's chat: the completion tokens its reasoning took (absent otherwise)."""

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler) -> dict:
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


class CachedTokensDetails(BaseModel):
    """Where the prompt's cached tokens came from, per KV cache tier (SGLang's shape): they sum to
    usage.prompt_tokens_details.cached_tokens; storage_backend names the storage tier when it served any."""

    device: int
    host: int = 0
    storage: int = 0
    storage_backend: str | None = None


class SglExt(BaseModel):
    """SGLang's extension object beside the standard fields; holds only what the request asked for."""

    cached_tokens_details: CachedTokensDetails | None = None
    routed_experts: list[list[list[list[int]]]] | None = None
    """Indexed by choice index: one [MoE layers][top_k] list of expert ids per token the response carries
    (a streamed chunk: its new tokens; an empty list for a choice it has none of)."""

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler) -> dict:
        return {name: value for name, value in handler(self).items() if value is not None}


class _ResponseBase(_WithExtensions):
    """Fields every completion and chat response or chunk has."""

    EXTENSIONS: ClassVar[tuple[str, ...]] = ("sglext",)

    id: str
    created: int
    model: str
    usage: Usage | None = None
    sglext: SglExt | None = None


class CompletionResponse(_ResponseBase):
    """A whole completion, or one streamed chunk of it (same object type, as in OpenAI's API)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    """The token's UTF-8 bytes (a token's text may hold only part of a character)."""


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """JSON text that validates against the function's parameters schema (constrained decoding)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: ChatRole = "assistant"
    """The final message's role when it is continued (add_generation_prompt false), as vLLM."""
    content: str | None
    """None when the answer is tool calls only (OpenAI's shape)."""
    reasoning_content: str | None = None
    """vLLM's and SGLang's: a reasoning model's reasoning, apart from the answer (absent for other models)."""
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_calls(self, handler) -> dict:
        return {name: value for name, value in handler(self).items()
                if value is not None or name not in ("tool_calls", "reasoning_content")}


class ChatCompletionChoice(_WithHiddenStates):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    """SGLang extension, as in CompletionChoice."""


class _ChatResponseBase(_ResponseBase):
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("sglext", "prompt_token_ids")

    prompt_token_ids: list[int] | None = None
    """vLLM extension (return_token_ids): the rendered conversation's token ids (streamed: in the first chunk)."""


class ChatCompletionResponse(_ChatResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]


class ToolCallDelta(BaseModel):
    """OpenAI's streamed piece of a call: its first has the id, type and name, later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]

    @model_serializer(mode="wrap")
    def _omit_absent_fields(self, handler) -> dict:
        return {name: value for name, value in handler(self).items() if value is not None}


class ChatDelta(BaseModel):
    role: ChatRole | None = None
    """Only in a choice's first chunk."""
    content: str | None
    """None in a chunk that carries only tool calls or reasoning."""
    reasoning_content: str | None = None
    """A reasoning model's new reasoning text."""
    tool_calls: list[ToolCallDelta] | None = None
    hidden_states: list[list[float]] | None = None
    """SGLang extension: the choice's hidden states, in a chunk of their own after its text."""

    @model_serializer(mode="wrap")
    def _omit_absent_fields(self, handler) -> dict:
        return {name: value for name, value in handler(self).items()
                if value is not None or name not in ("role", "hidden_states", "tool_calls", "reasoning_content")}


class ChatChunkChoice(_WithExtensions):
    EXTENSIONS: ClassVar[tuple[str, ...]] = ("token_ids",)

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    token_ids: list[int] | None = None
    """vLLM extension (return_token_ids): the chunk's new token ids."""


class ChatCompletionChunk(_ChatResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tritonllm"
    root: str | None = None
    """The base model's served name (as SGLang), a LoRA adapter's directory (as vLLM)."""
    parent: str | None = None
    """A LoRA adapter's base model (vLLM's field); absent for the base model."""
    max_model_len: int | None = None
    """Most tokens (prompt + output) a request may hold, as vLLM and SGLang report it; absent when the engine's
    metrics cannot be read."""
    loaded: bool | None = None
    """Whether the adapter holds a slot in the engine now (else it loads on first use); absent when unknown."""

    @model_serializer(mode="wrap")
    def _omit_absent_fields(self, handler) -> dict:
        return {name: value for name, value in handler(self).items() if value is not None}


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error body (see errors.AdapterError.body); documented in the OpenAPI schema."""

    error: ErrorDetail
