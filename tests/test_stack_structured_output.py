"""Structured output through the whole stack: OpenAI's response_format, SGLang's json_schema / regex / ebnf and vLLM's
guided_* fields with the official openai SDK, the same constraints from tritonclient, and their errors."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import lark
import openai
import pytest
import regex
from stack_helpers import grpc_generate

def bounded(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def decimal(low: float, high: float, step: float) -> dict:
    """A bounded number with a fixed precision (a free fraction lets a small model sample digits forever); binary
    fractions as steps, so that jsonschema's float arithmetic checks multipleOf exactly."""
    return {"type": "number", "minimum": low, "maximum": high, "multipleOf": step}


def text(max_length: int, **more) -> dict:
    return {"type": "string", "maxLength": max_length, **more}


def closed(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with these properties only (all required unless listed)."""
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


POINT = closed({"x": bounded(0, 10), "y": bounded(0, 10)})
SCHEMAS = {
    "person": closed({"name": text(20), "age": bounded(0, 120)}),
    "address": closed({"street": text(30), "city": text(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "tags": closed({"tags": {"type": "array", "items": text(10), "minItems": 2, "maxItems": 4}}),
    "color": closed({"color": {"enum": ["red", "green", "blue"]}}),
    "weather": closed({"city": text(15), "celsius": decimal(-50, 60, 0.5)}),
    "nullable": closed({"active": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 20}}),
    "optional": closed({"id": bounded(1, 1000), "label": text(15), "rank": bounded(1, 5)}, required=["id"]),
    "points": closed({"points": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 3}}),
    "nested": closed({"user": closed({"name": text(15), "roles": {
        "type": "array", "items": {"enum": ["admin", "editor", "viewer"]}, "maxItems": 3}})}),
    "phone": closed({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
    "date": closed({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}),
    "const": closed({"version": {"const": "1.0"}, "ok": {"type": "boolean"}}),
    "level": closed({"level": {"enum": [1, 2, 3]}, "reason": text(25)}),
    "triple": closed({"values": {"type": "array", "items": bounded(-100, 100), "minItems": 3, "maxItems": 3}}),
    "shape": closed({"shape": {"anyOf": [closed({"radius": bounded(1, 10)}), closed({"side": bounded(1, 10)})]}}),
    "refs": {"$defs": {"point": POINT}, **closed({"start": {"$ref": "#/$defs/point"},
                                                  "end": {"$ref": "#/$defs/point"}})},
    "code": closed({"code": {"type": "string", "minLength": 3, "maxLength": 5}}),
    "price": closed({"item": text(20), "price": {**decimal(0, 1000, 0.25), "exclusiveMinimum": 0}}),
    "list": {"type": "array", "items": {"enum": ["apple", "pear", "plum"]}, "minItems": 1, "maxItems": 5},
    "username": closed({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"}}),
    "matrix": closed({"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "items": bounded(0, 9), "minItems": 2, "maxItems": 2}}}),
    "movie": closed({"title": text(30), "year": bounded(1900, 2030), "rating": decimal(0, 10, 0.5)},
                    required=["title", "year"]),
}

# Arithmetic with bounded repetition and nesting, so that every output ends within max_tokens.
ARITHMETIC = r"""
start: expr
expr: term (ADDOP term)~0..3
term: factor (MULOP factor)~0..2
factor: NUMBER | "(" NUMBER (ADDOP NUMBER)~1..2 ")"
ADDOP: "+" | "-"
MULOP: "*" | "/"
NUMBER: /[0-9]{1,3}/
"""
ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term ([-+] term){0,3}
term ::= factor ([*/] factor){0,2}
factor ::= number | "(" number ([-+] number){1,2} ")"
number ::= [0-9]{1,3}
"""


def test_json_schemas_at_temperature_validate(stack):
    """Every completion of every schema, sampled at temperature 0.7 (two choices each, four requests at a time:
    the test stack's max_num_seqs), parses and validates."""
    assert len(SCHEMAS) >= 20

    async def run_all():
        running = asyncio.Semaphore(4)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                                      timeout=600) as aclient:
            async def one(name: str, schema: dict):
                async with running:
                    response = await aclient.completions.create(
                        model=stack.model_name, prompt=f"Here is a {name} as a JSON object: ", max_tokens=160,
                        temperature=0.7, n=2, seed=len(name),
                        extra_body={"response_format": {"type": "json_schema", "json_schema": {
                            "name": name, "schema": schema, "strict": True}}})
                return name, schema, response
            return await asyncio.gather(*(one(name, schema) for name, schema in SCHEMAS.items()))

    for name, schema, response in asyncio.run(run_all()):
        for choice in response.choices:
            assert choice.finish_reason == "stop", (name, choice.text)
            jsonschema.validate(json.loads(choice.text), schema)


def test_json_object(complete, client, stack):
    completion = complete(prompt="A JSON object describing a cat: ", max_tokens=120, temperature=0.7, seed=3,
                          extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)
    chat = client.chat.completions.create(
        model=stack.model_name, messages=[{"role": "user", "content": "Describe a dog in JSON."}], max_tokens=120,
        temperature=0.7, seed=4, response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    assert chat.choices[0].finish_reason == "stop"


def test_sglang_json_schema_string_and_vllm_guided_json(complete):
    schema = SCHEMAS["person"]
    for field, value in (("json_schema", json.dumps(schema)), ("guided_json", schema)):
        completion = complete(prompt="A person: ", max_tokens=60, temperature=0.7, seed=1, extra_body={field: value})
        jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize("pattern", [r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no)(, because [a-z ]{5,40})?\.",
                                     r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}", r"-?\d{1,3}\.\d{2}"])
def test_regex_output_fullmatches(complete, pattern):
    completion = complete(prompt="Answer: ", max_tokens=48, temperature=0.7, n=3, seed=9,
                          extra_body={"regex": pattern})
    for choice in completion.choices:
        assert regex.fullmatch(pattern, choice.text), choice.text
        assert choice.finish_reason == "stop"


def test_guided_choice_and_regex(complete):
    completion = complete(prompt="Is the sky blue? ", max_tokens=8, temperature=0.9, n=4, seed=2,
                          extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert {choice.text for choice in completion.choices} <= {"yes", "no", "it depends"}
    completion = complete(prompt="A year: ", max_tokens=8, temperature=0.9, extra_body={"guided_regex": r"19\d\d"})
    assert regex.fullmatch(r"19\d\d", completion.choices[0].text)


@pytest.mark.parametrize("grammar", [ARITHMETIC, ARITHMETIC_GBNF], ids=["lark", "gbnf"])
def test_ebnf_output_parses_with_its_grammar(complete, grammar):
    parser = lark.Lark(ARITHMETIC)
    completion = complete(prompt="An arithmetic expression: ", max_tokens=160, temperature=0.7, n=3, seed=5,
                          extra_body={"ebnf": grammar})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        parser.parse(choice.text)


def test_streamed_constrained_output_matches_non_streamed(complete):
    """stream, n, seed and logprobs together: the same choices as without streaming."""
    kwargs = dict(prompt="A color as JSON: ", max_tokens=40, temperature=0.8, n=2, seed=21, logprobs=2,
                  extra_body={"json_schema": json.dumps(SCHEMAS["color"])})
    whole = complete(**kwargs)
    texts, reasons = ["", ""], [None, None]
    for chunk in complete(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                assert reasons[choice.index] is None
                reasons[choice.index] = choice.finish_reason
    assert texts == [choice.text for choice in whole.choices]
    assert reasons == ["stop", "stop"]
    for choice in whole.choices:
        assert json.loads(choice.text)["color"] in ("red", "green", "blue")
        assert "".join(choice.logprobs.tokens) == choice.text


def test_max_tokens_cut_reports_length(complete):
    completion = complete(prompt="A JSON address: ", max_tokens=5, temperature=0,
                          extra_body={"json_schema": json.dumps(SCHEMAS["address"])})
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.text.startswith("{")


@pytest.mark.parametrize("fields, param, message", [
    ({"regex": "[0-9"}, "regex", "unclosed character class"),
    ({"json_schema": '{"type": "nonsense"}'}, "json_schema", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"ebnf": "start: undefined_rule"}, "ebnf", "undefined_rule"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid ebnf"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_constraint_is_400_with_llguidance_message(complete, fields, param, message, stream):
    with pytest.raises(openai.BadRequestError) as raised:
        result = complete(prompt="Hi", max_tokens=5, stream=stream, extra_body=fields)
        list(result) if stream else None
    error = raised.value.body
    assert error["param"] == param and message in error["message"], error
    assert complete(prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"  # the server is fine


def test_constrained_requests_leave_concurrent_greedy_outputs_unchanged(stack, complete):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "The best way to learn is"]
    alone = [complete(prompt=p, max_tokens=16, temperature=0).choices[0].text for p in prompts]

    async def mixed():
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as aclient:
            def create(**kwargs):
                return aclient.completions.create(model=stack.model_name, **kwargs)
            plain = [create(prompt=p, max_tokens=16, temperature=0) for p in prompts]
            constrained = [create(prompt=p, max_tokens=40, temperature=0.7, extra_body={
                "json_schema": json.dumps(SCHEMAS["person"])}) for p in prompts]
            return await asyncio.gather(*plain, *constrained)

    responses = asyncio.run(mixed())
    assert [r.choices[0].text for r in responses[:4]] == alone
    for response in responses[4:]:
        jsonschema.validate(json.loads(response.choices[0].text), SCHEMAS["person"])


def test_tritonclient_sampling_parameters_carry_constraints(stack):
    # \d is [0-9] here (test_structured_output.py): six digits of U+1FBF0's block, several tokens each, once took
    # the 20 tokens of a sampled run
    responses, error = grpc_generate(stack, "My number is", {"max_tokens": 20, "regex": r"\d{3}-\d{4}"}, stream=True)
    assert error is None
    output = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
    assert regex.fullmatch("[0-9]{3}-[0-9]{4}", output) and responses[-1].as_numpy("finish_reason")[0] == b"stop"
    responses, error = grpc_generate(stack, "Hi", {"max_tokens": 5, "regex": "[0-9", "ebnf": "start: \"a\""},
                                     stream=False)
    assert responses == [] and "only one constraint" in str(error)
    responses, error = grpc_generate(stack, "Hi", {"json_schema": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}, stream=False)
    assert responses == [] and "[invalid_request:json_schema]" in str(error)


# --- xgrammar's structural tag `format` form (SGLang's newer structural_tag) ------------------------------------

WEATHER = closed({"city": text(12), "unit": {"enum": ["C", "F"]}})
TOOL_PROMPT = ('Calls of the weather tool, one per line:\n<function=get_weather>{"city": "Paris"}</function>\n'
               '<function=get_weather>{"city": "Rome"}</function>\n')
ANSWER_FORMAT = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "Answer: "},
    {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]{3}"},
                                {"type": "json_schema", "json_schema": POINT}]},
    {"type": "const_string", "value": " (done)"}]}}
ONE_CALL_FORMAT = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
    "tags": [{"type": "tag", "begin": "<function=get_weather>", "end": "</function>",
              "content": {"type": "json_schema", "json_schema": WEATHER}}]}}


def test_structural_tag_format_sequence_with_the_sdk(complete, client, stack):
    completion = complete(prompt="The answer is 42. ", max_tokens=40, temperature=0,
                          extra_body={"response_format": ANSWER_FORMAT})
    choice = completion.choices[0]
    answer = regex.fullmatch(r"Answer: ([0-9]{3}|\{.*\}) \(done\)", choice.text)
    assert answer and choice.finish_reason == "stop", choice
    if answer.group(1).startswith("{"):
        jsonschema.validate(json.loads(answer.group(1)), POINT)
    # the same tag as OpenAI's response_format, in a chat
    chat = client.chat.completions.create(model=stack.model_name, max_completion_tokens=40, temperature=0,
                                          messages=[{"role": "user", "content": "Give me a number."}],
                                          response_format=ANSWER_FORMAT)
    assert regex.fullmatch(r"Answer: ([0-9]{3}|\{.*\}) \(done\)", chat.choices[0].message.content), chat


def test_structural_tag_format_triggered_tags_force_one_valid_call(complete):
    choice = complete(prompt=TOOL_PROMPT, max_tokens=60, temperature=0,
                      extra_body={"response_format": ONE_CALL_FORMAT}).choices[0]
    call = regex.fullmatch(r"(?s)(.*?)<function=get_weather>(\{.*\})</function>", choice.text)
    assert call and "<function=" not in call.group(1) and choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(call.group(2)), WEATHER)  # the unit too, which the prompt's examples lack


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": WEATHER, "style": "qwen_xml"}, "format.style 'qwen_xml'"),
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "json_schema", "json_schema": WEATHER}]},
     "format.elements[0] must end the format"),
    ({"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "[0-9"}, "end": "</a>"},
     "format.content.pattern is not a valid regex"),
])
def test_structural_tag_format_that_does_not_map_is_400(complete, fmt, words):
    with pytest.raises(openai.BadRequestError) as raised:
        complete(prompt="Hi", max_tokens=5, extra_body={"response_format": {"type": "structural_tag", "format": fmt}})
    error = raised.value.body
    assert error["param"] == "response_format" and words in error["message"], error


def test_tritonclient_carries_the_structural_tag_format(stack):
    responses, error = grpc_generate(stack, "The answer is 42. ", {"max_tokens": 40, "temperature": 0,
                                                                   "structural_tag": ANSWER_FORMAT}, stream=False,
                                     exclude_input_in_output=True)
    assert error is None
    assert regex.fullmatch(r"Answer: ([0-9]{3}|\{.*\}) \(done\)", responses[-1].as_numpy("text_output")[0].decode())
    responses, error = grpc_generate(stack, "Hi", {"structural_tag": {"type": "structural_tag", "format": {
        "type": "const_string"}}}, stream=False)
    assert responses == [] and "[invalid_request:structural_tag]" in str(error) and "format.value" in str(error)
