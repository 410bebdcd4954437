"""How a prompt becomes token ids: text with or without special tokens, and the chat template's controls
(generation prompt, a continued final message, template variables), with the model's own tokenizer."""

from __future__ import annotations

import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.engine_core import ModelLimits
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.processing.input_processor import InputProcessor, PromptOptions, load_tokenizer

MESSAGES = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3,"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _processor(tokenizer, config: EngineConfig = EngineConfig()) -> InputProcessor:
    limits = ModelLimits(name="m", vocab_size=len(tokenizer), max_model_len=64, capacity=64, is_moe=False, arch=None)
    return InputProcessor(config, limits, tokenizer, grammars=None)


class _BosTokenizer:
    """A tokenizer that starts a text with BOS (0) when it adds special tokens (the default model has no BOS)."""

    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt, continue_final_message, tokenize, **kwargs):
        return "".join(message["content"] for message in messages)

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token for token in token_ids if token).decode()

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [chr(token) for token in token_ids]


@pytest.mark.parametrize("prompt, options, expected", [
    ("Hi", PromptOptions(), [0, 72, 105]),  # a text gets BOS
    ("Hi", PromptOptions(add_special_tokens=False), [72, 105]),
    ([{"role": "user", "content": "Hi"}], PromptOptions(), [72, 105]),  # a chat's template has its own
    ([{"role": "user", "content": "Hi"}], PromptOptions(add_special_tokens=True), [0, 72, 105]),
])
def test_special_tokens_by_prompt_kind_and_add_special_tokens(prompt, options, expected):
    assert _processor(_BosTokenizer()).tokenize(prompt, options).token_ids == expected


@pytest.mark.parametrize("options, expected", [
    (PromptOptions(), dict(add_generation_prompt=True)),
    (PromptOptions(add_generation_prompt=False), dict(add_generation_prompt=False)),
    (PromptOptions(add_generation_prompt=False, continue_final_message=True), dict(continue_final_message=True)),
])
def test_chat_template_controls_reach_the_template(tokenizer, options, expected):
    tokenized = _processor(tokenizer).tokenize(MESSAGES, options)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, **expected)
    assert tokenized.token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert tokenized.text == rendered


def test_a_continued_message_ends_open(tokenizer):
    text = _processor(tokenizer).tokenize(MESSAGES, PromptOptions(add_generation_prompt=False,
                                                                  continue_final_message=True)).text
    assert text.endswith("1, 2, 3,")  # no end-of-turn after the assistant's words


def test_chat_template_kwargs_are_template_variables_and_cannot_override_the_renderer(tokenizer):
    templated = load_tokenizer(tokenizer.name_or_path)
    templated.chat_template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    processor = _processor(templated)
    assert processor.tokenize(MESSAGES, PromptOptions(chat_template_kwargs={"greeting": "Hello"})).text == \
        "Hello|Count to five.|1, 2, 3,"
    with pytest.raises(InvalidRequest) as refused:
        processor.tokenize(MESSAGES, PromptOptions(chat_template_kwargs={"tokenize": True}))
    assert refused.value.param == "chat_template_kwargs" and "tokenize" in refused.value.message


def test_a_priority_is_refused_unless_the_server_schedules_by_priority(tokenizer):
    """As vLLM: a non-default priority on a first-come-first-served server is a 400 naming it, not ignored."""
    params = SamplingParams(priority=-1)
    with pytest.raises(InvalidRequest) as refused:
        _processor(tokenizer).process("r", "Hi", params)
    assert refused.value.param == "priority" and "--scheduling-policy fcfs" in str(refused.value)
    assert _processor(tokenizer).process("r", "Hi", SamplingParams()).params.priority == 0
    by_priority = _processor(tokenizer, EngineConfig(scheduling_policy="priority"))
    assert by_priority.process("r", "Hi", params).params.priority == -1
