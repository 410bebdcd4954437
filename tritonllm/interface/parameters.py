"""The request parameters, declared once, each by its `SamplingParams` field: name, type, default, valid range,
the API spellings that set them, and the error each violation gives (`PARAMETERS` is made from the fields; the
adapter's request fields and the values it sends are made from `PARAMETERS`). The engine parses `sampling_parameters` JSON with `SamplingParams.from_dict`
and the OpenAI adapter validates the same dict with it before sending, so both sides accept and refuse exactly
the same values with the same messages.

Triton clients (vllm_backend convention) may send numbers and booleans as strings: every value is cast here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field, fields
from types import UnionType
from typing import Any, NewType, Union, get_args, get_origin, get_type_hints

import regex  # like `re`, plus partial matching (stop_regex text is held back while it may still match)

from tritonllm.interface.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_TOKEN_ID = 2**31 - 1  # Triton's input_ids tensor is INT32
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # at most one per request
BEAM_SEARCH_EXCLUDES = (*CONSTRAINTS, "stop", "stop_regex", "logit_bias", "allowed_token_ids", "frequency_penalty",
                        "presence_penalty", "repetition_penalty", "return_hidden_states",
                        "return_prompt_hidden_states", "return_routed_experts")
"""Parameters that must keep their default with use_beam_search: they would change or cut a beam's tokens after
it is ranked, or return what beams do not keep."""

JsonText = NewType("JsonText", str)
"""A JSON object as text; clients may send the object itself."""

_KINDS = {int: "int", float: "float", bool: "bool", str: "string", JsonText: "json", list[str]: "strings",
          list[int]: "token_ids", dict[int, float]: "logit_bias"}
"""How a value is cast, by the type of its SamplingParams field."""


@dataclass(frozen=True)
class Parameter:
    """One sampling parameter, as its SamplingParams field declares it. `kind` (from the field's type) says how a
    value is cast: int, float, bool, string, strings (a string or a list of them), token_ids (a list of ids),
    logit_bias (token id → bias), json (an object, or a JSON string of one). Numbers must lie in [minimum,
    maximum] (an open end when exclusive), or equal `special`."""

    name: str
    kind: str
    default: Any  # the value of an absent parameter
    nullable: bool  # null is a value of its own (the field's type admits None; e.g. max_tokens: up to the context)
    doc: str
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


_DECLARATION = "parameter"  # the key of a SamplingParams field's metadata that holds the rest of its declaration


def parameter(default: Any, doc: str, *, minimum: float | None = None, maximum: float | None = None,
              exclusive_minimum: bool = False, special: int | None = None, api_names: tuple[str, ...] = ()) -> Any:
    """A SamplingParams field: its default and what else a Parameter holds (name, kind and nullable come from
    the field itself)."""
    declaration = {"doc": doc, "minimum": minimum, "maximum": maximum, "exclusive_minimum": exclusive_minimum,
                   "special": special, "api_names": api_names}
    if isinstance(default, (list, dict)):  # (only empty ones: a fresh one per request)
        return field(default_factory=type(default), metadata={_DECLARATION: declaration})
    return field(default=default, metadata={_DECLARATION: declaration})


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
    """One request's generation parameters, each field the declaration of one (PARAMETERS is made from them)."""

    max_tokens: int | None = parameter(16, "tokens to generate; null: up to the end of the context", minimum=0,
                                       api_names=("max_completion_tokens",))
    temperature: float = parameter(1.0, "0: greedy", minimum=0.0, maximum=2.0)
    top_p: float = parameter(1.0, "nucleus sampling mass", minimum=0.0, maximum=1.0, exclusive_minimum=True)
    top_k: int = parameter(-1, "sample among the k most likely tokens", minimum=1, special=-1)
    min_p: float = parameter(0.0, "drop tokens below min_p times the most likely one's probability", minimum=0.0,
                             maximum=1.0)
    seed: int | None = parameter(None, "seed of the choice's random draws (choice i uses seed + i)")
    n: int = parameter(1, "choices returned", minimum=1)
    best_of: int | None = parameter(None, "choices generated, the n most likely returned; null: n", minimum=1)
    stop: list[str] = parameter([], "stop strings (not part of the output unless no_stop_trim)")
    stop_regex: list[str] = parameter([], "regular expressions (`regex` module syntax) that stop the output "
                                      "(SGLang's)")
    stop_token_ids: list[int] = parameter([], "token ids that stop the output")
    no_stop_trim: bool = parameter(False, "keep the matched stop string or stop token's text in the output "
                                   "(SGLang's)")
    ignore_eos: bool = parameter(False, "keep generating after EOS")
    min_tokens: int = parameter(0, "tokens generated before EOS, stop tokens and stop strings apply", minimum=0)
    skip_special_tokens: bool = parameter(True, "leave special tokens out of the text")
    frequency_penalty: float = parameter(0.0, "OpenAI's, over output tokens", minimum=-2.0, maximum=2.0)
    presence_penalty: float = parameter(0.0, "OpenAI's, over output tokens", minimum=-2.0, maximum=2.0)
    repetition_penalty: float = parameter(1.0, "over prompt and output tokens (divides positive logits)",
                                          minimum=0.0, maximum=2.0, exclusive_minimum=True)
    logit_bias: dict[int, float] = parameter({}, "token id → bias added to its logit", minimum=-100.0,
                                             maximum=100.0)
    allowed_token_ids: list[int] = parameter([], "only these tokens may be generated (vLLM's); empty: any")
    logprobs: int | None = parameter(None, "alternatives per generated token with logprobs; null: no logprobs",
                                     minimum=0, maximum=MAX_LOGPROBS, api_names=("top_logprobs",))
    prompt_logprobs: int | None = parameter(None, "logprobs of the prompt tokens, with this many alternatives "
                                            "(vLLM's)", minimum=0, maximum=MAX_LOGPROBS)
    json_schema: JsonText | None = parameter(None, "constrain the output to a JSON schema",
                                             api_names=("response_format", "guided_json"))
    regex: str | None = parameter(None, "constrain the whole output to match a regular expression",
                                  api_names=("guided_regex",))
    ebnf: str | None = parameter(None, "constrain the output to a Lark or GBNF grammar",
                                 api_names=("guided_grammar", "guided_choice"))
    structural_tag: JsonText | None = parameter(None, "SGLang's structural tag: free text in which each trigger "
                                                "starts one of the structures (begin, JSON per its schema, end), "
                                                "or xgrammar's format tree",
                                                api_names=("response_format",))
    lora_path: str | None = parameter(None, "LoRA adapter: its name or a path inside the adapters directory")
    cache_salt: str | None = parameter(None, "requests share cached prompt prefixes only with requests of the "
                                       "same salt (vLLM's and SGLang's; e.g. one per tenant)")
    priority: int = parameter(0, "scheduling priority (vLLM's): lower runs first, equal priorities in arrival order; "
                              "non-zero only on a server with --scheduling-policy priority")
    return_hidden_states: bool = parameter(False, "each generated token's final hidden state (SGLang's)")
    return_prompt_hidden_states: bool = parameter(False, "each prompt token's final hidden state too (echo)")
    return_routed_experts: bool = parameter(False, "MoE models: each generated token's experts per layer "
                                            "(SGLang's)")
    separate_reasoning: bool = parameter(True, "a reasoning model's chat: its reasoning apart from the answer "
                                         "(false: all in the text, as the model wrote it; SGLang's)")
    use_beam_search: bool = parameter(False, "beam search (vLLM's) over max(n, best_of) beams, the n best returned; "
                                      "not streamed; temperature and top-k/top-p/min-p play no part in it")
    length_penalty: float = parameter(1.0, "beam search: a finished beam's score is its cumulative logprob / "
                                      "(its generated tokens ** length_penalty)")
    early_stopping: bool = parameter(False, "beam search: stop once max(n, best_of) beams have finished (false: "
                                     "once no running beam can beat the worst finished one)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.best_of or self.n)

    @property
    def has_filters(self) -> bool:
        """top-k, top-p or min-p cut the distribution a token is drawn from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

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
        if self.use_beam_search:
            self._check_beam_search()
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}",
                                     "stop_regex") from None

    def _check_beam_search(self) -> None:
        """What beam search does not combine with: anything that changes or cuts a beam's tokens, and outputs it
        does not keep per beam. (vLLM ignores most of them; a 400 says so instead.)"""
        if self.max_tokens == 0:
            raise InvalidRequest("use_beam_search needs max_tokens >= 1", "max_tokens")
        refused = [name for name in BEAM_SEARCH_EXCLUDES if getattr(self, name) != PARAMETERS[name].default]
        if refused:
            raise InvalidRequest(f"{refused[0]} cannot be combined with use_beam_search", refused[0])

    def check_streamable(self) -> None:
        """A streamed request cannot use best_of > n, nor beam search: the best choices are known only at the
        end."""
        if self.use_beam_search:
            raise InvalidRequest("use_beam_search cannot be streamed: the best beams are known only at the end",
                                 "use_beam_search")
        if self.num_sequences > self.n:
            raise InvalidRequest("best_of > n cannot be streamed: the best choices are known only at the end",
                                 "best_of")

    def non_defaults(self) -> dict[str, Any]:
        """The parameters that differ from their defaults: all that `sampling_parameters` must carry to mean these
        parameters (JSON-ready)."""
        values = {name: getattr(self, name) for name in PARAMETERS}
        return {name: value for name, value in values.items() if value != PARAMETERS[name].default}


def _declared(spec: dataclasses.Field, hint: Any) -> Parameter:
    """The Parameter a SamplingParams field declares."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    [value_type] = [member for member in members if member is not type(None)]
    default = spec.default if spec.default_factory is MISSING else spec.default_factory()
    return Parameter(spec.name, _KINDS[value_type], default, type(None) in members, **spec.metadata[_DECLARATION])


_HINTS = get_type_hints(SamplingParams)
PARAMETERS: dict[str, Parameter] = {spec.name: _declared(spec, _HINTS[spec.name]) for spec in fields(SamplingParams)}
