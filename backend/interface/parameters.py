"""The request parameters, declared once: name, type, default, valid range, the API spellings that set them,
and the error each violation gives. The engine parses `sampling_parameters` JSON with `SamplingParams.from_dict`
and the OpenAI adapter validates the same dict with it before sending, so both sides accept and refuse exactly
the same values with the same messages.

Triton clients (vllm_backend convention) may send numbers and booleans as strings: every value is cast here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import regex  # like `re`, plus partial matching (stop_regex text is held back while it may still match)

from backend.interface.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1  # Triton's input_ids tensor is INT32
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # at most one per request


@dataclass(frozen=True)
class Parameter:
    """One sampling parameter. `kind` says how a value is cast: int, float, bool, string, strings (a string or a
    list of them), token_ids (a list of ids), logit_bias (token id → bias), json (an object, or a JSON string of
    one). Numbers must lie in [minimum, maximum] (an open end when exclusive), or equal `special`."""

    name: str
    kind: str
    doc: str
    nullable: bool = False  # null is a value of its own (e.g. max_tokens: up to the context length)
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    special: int | None = None  # a value outside the range with a meaning of its own (top_k -1: off)
    api_names: tuple[str, ...] = ()  # OpenAI / SGLang / vLLM spellings that set this field (errors name them)

    def range_text(self) -> str | None:
        if self.minimum is None and self.maximum is None:
            return None
        low = "(" if self.exclusive_minimum else "["
        if self.maximum is None:
            text = f"> {self.minimum:g}" if self.exclusive_minimum else f">= {self.minimum:g}"
        else:
            text = f"in {low}{self.minimum:g}, {self.maximum:g}]"
        return text if self.special is None else f"{self.special} or {text}"

    def in_range(self, value: float) -> bool:
        if self.special is not None and value == self.special:
            return True
        if self.minimum is not None and (value <= self.minimum if self.exclusive_minimum else value < self.minimum):
            return False
        return self.maximum is None or value <= self.maximum


_PARAMETERS = (
    Parameter("max_tokens", "int", "tokens to generate; null: up to the end of the context", nullable=True,
              minimum=0, api_names=("max_completion_tokens",)),
    Parameter("temperature", "float", "0: greedy", minimum=0.0, maximum=2.0),
    Parameter("top_p", "float", "nucleus sampling mass", minimum=0.0, maximum=1.0, exclusive_minimum=True),
    Parameter("top_k", "int", "sample among the k most likely tokens", minimum=1, special=-1),
    Parameter("min_p", "float", "drop tokens below min_p times the most likely one's probability",
              minimum=0.0, maximum=1.0),
    Parameter("seed", "int", "seed of the choice's random draws (choice i uses seed + i)", nullable=True),
    Parameter("n", "int", "choices returned", minimum=1),
    Parameter("best_of", "int", "choices generated, the n most likely returned; null: n", nullable=True,
              minimum=1),
    Parameter("stop", "strings", "stop strings (not part of the output unless no_stop_trim)"),
    Parameter("stop_regex", "strings", "regular expressions (`regex` module syntax) that stop the output"),
    Parameter("stop_token_ids", "token_ids", "token ids that stop the output"),
    Parameter("no_stop_trim", "bool", "keep the matched stop string or stop token's text in the output"),
    Parameter("ignore_eos", "bool", "keep generating after EOS"),
    Parameter("min_tokens", "int", "tokens generated before EOS, stop tokens and stop strings apply", minimum=0),
    Parameter("skip_special_tokens", "bool", "leave special tokens out of the text"),
    Parameter("frequency_penalty", "float", "OpenAI's, over output tokens", minimum=-2.0, maximum=2.0),
    Parameter("presence_penalty", "float", "OpenAI's, over output tokens", minimum=-2.0, maximum=2.0),
    Parameter("repetition_penalty", "float", "over prompt and output tokens (divides positive logits)",
              minimum=0.0, maximum=2.0, exclusive_minimum=True),
    Parameter("logit_bias", "logit_bias", "token id → bias added to its logit", minimum=-100.0, maximum=100.0),
    Parameter("allowed_token_ids", "token_ids", "only these tokens may be generated (vLLM's); empty: any"),
    Parameter("logprobs", "int", "alternatives per generated token with logprobs; null: no logprobs",
              nullable=True, minimum=0, maximum=MAX_LOGPROBS, api_names=("top_logprobs",)),
    Parameter("prompt_logprobs", "int", "logprobs of the prompt tokens, with this many alternatives",
              nullable=True, minimum=0, maximum=MAX_LOGPROBS),
    Parameter("json_schema", "json", "constrain the output to a JSON schema", nullable=True,
              api_names=("response_format", "guided_json")),
    Parameter("regex", "string", "constrain the whole output to match a regular expression", nullable=True,
              api_names=("guided_regex",)),
    Parameter("ebnf", "string", "constrain the output to a Lark or GBNF grammar", nullable=True,
              api_names=("guided_grammar", "guided_choice")),
    Parameter("structural_tag", "json", "SGLang's structural tag: free text in which each trigger starts one of "
              "the structures (begin, JSON per its schema, end)", nullable=True, api_names=("response_format",)),
    Parameter("lora_path", "string", "LoRA adapter: its name or a path inside the adapters directory",
              nullable=True),
    Parameter("cache_salt", "string", "requests share cached prompt prefixes only with requests of the same salt "
              "(vLLM's and SGLang's; e.g. one per tenant)", nullable=True),
    Parameter("return_hidden_states", "bool", "each generated token's final hidden state"),
    Parameter("return_prompt_hidden_states", "bool", "each prompt token's final hidden state too (echo)"),
    Parameter("return_routed_experts", "bool", "MoE models: each generated token's experts per layer"),
)
PARAMETERS: dict[str, Parameter] = {parameter.name: parameter for parameter in _PARAMETERS}


def _fail(parameter: Parameter, message: str) -> InvalidRequest:
    return InvalidRequest(f"{parameter.name} {message}", parameter.name)


def _number(parameter: Parameter, value: Any, integer: bool) -> int | float:
    what = "an integer" if integer else "a number"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _fail(parameter, f"must be {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _fail(parameter, f"must be {what}, got {value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise _fail(parameter, f"must be {what}, got {value!r}")
        value = int(value)
    if not parameter.in_range(value):
        raise _fail(parameter, f"must be {parameter.range_text()}, got {value!r}")
    return value


def _bool(parameter: Parameter, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _fail(parameter, f"must be a boolean, got {value!r}")


def _token_id(parameter: Parameter, value: Any) -> int:
    try:
        token_id = int(value) if isinstance(value, str) else value
    except ValueError:
        token_id = None
    if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= MAX_TOKEN_ID:
        raise _fail(parameter, f"must hold token ids (integers from 0 to {MAX_TOKEN_ID}), got {value!r}")
    return token_id


def _strings(parameter: Parameter, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _fail(parameter, "must be a string or a list of strings")
    return [item for item in value if item]


def _cast(parameter: Parameter, value: Any) -> Any:
    """The value as the engine's field holds it; InvalidRequest naming the parameter when it is not valid."""
    if value is None:
        if parameter.nullable:
            return None
        if parameter.kind in ("strings", "token_ids", "logit_bias"):
            return [] if parameter.kind != "logit_bias" else {}
        raise _fail(parameter, "must not be null")
    kind = parameter.kind
    if kind in ("int", "float"):
        return _number(parameter, value, kind == "int")
    if kind == "bool":
        return _bool(parameter, value)
    if kind == "strings":
        return _strings(parameter, value)
    if kind == "token_ids":
        if not isinstance(value, list):
            raise _fail(parameter, "must be a list of token ids")
        return [_token_id(parameter, item) for item in value]
    if kind == "logit_bias":
        if not isinstance(value, dict):
            raise _fail(parameter, "must be an object mapping token ids to biases")
        return {_token_id(parameter, key): _number(parameter, bias, integer=False) for key, bias in value.items()}
    if kind == "json":
        if isinstance(value, (dict, bool)):  # (a JSON schema may be true or false)
            return json.dumps(value)
        if not isinstance(value, str):
            raise _fail(parameter, "must be a JSON object, or a JSON string of one")
        try:
            parsed = json.loads(value) if value else None
        except json.JSONDecodeError as error:
            raise _fail(parameter, f"is not valid JSON: {error}") from None
        if value and not isinstance(parsed, (dict, bool)):
            raise _fail(parameter, "must be a JSON object")
        return value or None
    if not isinstance(value, str):  # string
        raise _fail(parameter, "must be a string")
    return value or None


@dataclass
class SamplingParams:
    """One request's generation parameters (defaults: an absent parameter); fields are PARAMETERS' names."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    no_stop_trim: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    return_hidden_states: bool = False
    return_prompt_hidden_states: bool = False
    return_routed_experts: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.best_of or self.n)

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(parameter name, grammar text) of the request's constraint, if it has one."""
        for name in CONSTRAINTS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    @property
    def stop_patterns(self) -> list[regex.Pattern]:
        return [regex.compile(pattern) for pattern in self.stop_regex]  # compiled patterns are cached

    @classmethod
    def from_json(cls, text: str | bytes | None) -> "SamplingParams":
        if text is None or (isinstance(text, (str, bytes)) and not text.strip()):
            return cls()
        try:
            values = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}", "sampling_parameters") from None
        if not isinstance(values, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object", "sampling_parameters")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        unknown = sorted(set(values) - set(PARAMETERS))
        if unknown:
            raise InvalidRequest(f"unsupported sampling parameter(s): {', '.join(unknown)}", unknown[0])
        params = cls(**{name: _cast(PARAMETERS[name], value) for name, value in values.items()})
        params._check_together()
        return params

    def _check_together(self) -> None:
        """The rules that involve more than one parameter."""
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequest(f"best_of must be >= n ({self.n}), got {self.best_of}", "best_of")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                                 "min_tokens")
        constraints = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise InvalidRequest(f"only one constraint per request: got {' and '.join(constraints)}", constraints[1])
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}",
                                     "stop_regex") from None

    def check_streamable(self) -> None:
        """A streamed request cannot use best_of > n: the best choices are known only at the end."""
        if self.num_sequences > self.n:
            raise InvalidRequest("best_of > n cannot be streamed: the best choices are known only at the end",
                                 "best_of")


assert [f.name for f in fields(SamplingParams)] == list(PARAMETERS), "SamplingParams and PARAMETERS disagree"
