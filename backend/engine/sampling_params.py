"""Per-request generation parameters, parsed and validated from the `sampling_parameters` JSON.

Triton clients (vllm_backend convention) may send numbers as strings, so every field is cast here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import regex  # like `re`, plus partial matching: needed to hold back text a stop_regex may still match
from typing import Any

from backend.errors import InvalidRequest

MAX_LOGPROBS = 20
CONSTRAINT_NAMES = ("json_schema", "regex", "ebnf")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidRequest(f"{name} must be a boolean, got {value!r}")


def _as_number(name: str, value: Any, kind: type) -> int | float:
    what = "an integer" if kind is int else "a number"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidRequest(f"{name} must be {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequest(f"{name} must be {what}, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise InvalidRequest(f"{name} must be {what}, got {value!r}")
        return int(value)
    return float(value)


def _as_string_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"{name} must be a string or a list of strings")
    return [v for v in value if v]


def _as_optional_string(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise InvalidRequest(f"{name} must be a string", param=name)


def _as_logit_bias(name: str, value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be an object mapping token ids to biases")
    bias = {}
    for key, amount in value.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{name} keys must be token ids, got {key!r}") from None
        bias[token_id] = _as_number(name, amount, float)
    return bias


def _as_json_schema(name: str, value: Any) -> str | None:
    """A JSON schema as SGLang sends it (a JSON string), or as an object."""
    return json.dumps(value) if isinstance(value, dict) else _as_optional_string(name, value)


def _as_int_list(name: str, value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"{name} must be a list of integers")
    return [_as_number(name, v, int) for v in value]


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None = up to the context length
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    best_of: int | None = None  # generate this many choices, keep the n most likely (None = n)
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text) in the output
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # number of top alternatives per token; None = no logprobs
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens, with this many alternatives
    # Constrained decoding (structured_output.py), at most one of: a JSON schema, a regular expression the whole
    # output must match, a Lark or GBNF grammar.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    lora_path: str | None = None  # a LoRA adapter: its name or a path inside the adapters directory
    return_hidden_states: bool = False  # each generated token's final hidden state (after the last norm)
    return_prompt_hidden_states: bool = False  # also each prompt token's (for echo)
    return_routed_experts: bool = False  # MoE models: each generated token's chosen experts per layer

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
        for name in CONSTRAINT_NAMES:
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
            raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise InvalidRequest("sampling_parameters must be a JSON object")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        params = cls()
        casts = {
            "temperature": lambda k, v: _as_number(k, v, float),
            "top_p": lambda k, v: _as_number(k, v, float),
            "min_p": lambda k, v: _as_number(k, v, float),
            "top_k": lambda k, v: _as_number(k, v, int),
            "n": lambda k, v: _as_number(k, v, int),
            "min_tokens": lambda k, v: _as_number(k, v, int),
            "max_tokens": lambda k, v: None if v is None else _as_number(k, v, int),
            "seed": lambda k, v: None if v is None else _as_number(k, v, int),
            "logprobs": lambda k, v: None if v is None else _as_number(k, v, int),
            "prompt_logprobs": lambda k, v: None if v is None else _as_number(k, v, int),
            "best_of": lambda k, v: None if v is None else _as_number(k, v, int),
            "frequency_penalty": lambda k, v: _as_number(k, v, float),
            "presence_penalty": lambda k, v: _as_number(k, v, float),
            "repetition_penalty": lambda k, v: _as_number(k, v, float),
            "logit_bias": _as_logit_bias,
            "ignore_eos": _as_bool,
            "skip_special_tokens": _as_bool,
            "no_stop_trim": _as_bool,
            "stop": _as_string_list,
            "stop_regex": _as_string_list,
            "stop_token_ids": _as_int_list,
            "json_schema": _as_json_schema,
            "regex": _as_optional_string,
            "ebnf": _as_optional_string,
            "lora_path": _as_optional_string,
            "return_hidden_states": _as_bool,
            "return_prompt_hidden_states": _as_bool,
            "return_routed_experts": _as_bool,
        }
        unknown = sorted(set(values) - set(casts))
        if unknown:
            raise InvalidRequest(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        for key, value in values.items():
            setattr(params, key, casts[key](key, value))
        params.validate()
        return params

    def validate(self) -> None:
        checks = [
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0"),
            (0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.n >= 1, "n must be >= 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.best_of is None or self.best_of >= self.n, "best_of must be >= n"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(t >= 0 for t in self.logit_bias), "logit_bias keys must be non-negative token ids"),
            (all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)
        constraints = [name for name in CONSTRAINT_NAMES if getattr(self, name) is not None]
        if len(constraints) > 1:
            raise InvalidRequest(f"only one constraint per request: got {' and '.join(constraints)}",
                                 param=constraints[1])
        for pattern in self.stop_regex:
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
