"""vLLM's API surface that its clients rely on, through the whole stack with the official openai SDK (httpx for
the routes it has no method for): token ids in and out (return_token_ids, return_tokens_as_token_ids, /tokenize,
/detokenize, Triton's tokenize_only), and the chat template's controls (add_generation_prompt,
continue_final_message, chat_template_kwargs, echo)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from stack_helpers import grpc_generate
from transformers import AutoTokenizer

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def _post(stack, path: str, **body) -> httpx.Response:
    """POST to the adapter's own root (vLLM's routes outside /v1)."""
    return httpx.post(f"{stack.base_url.removesuffix('/v1')}{path}", json=body, timeout=60)


def _extra(model_object, name: str):
    """A vLLM field the SDK keeps among the extras; it must be present."""
    assert name in model_object.model_extra, model_object
    return model_object.model_extra[name]


# --- token ids in and out -------------------------------------------------------------------------------------


def test_completion_returns_its_prompt_and_output_token_ids(stack, client, tokenizer):
    completion = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                                           extra_body={"return_token_ids": True})
    [choice] = completion.choices
    assert _extra(choice, "prompt_token_ids") == tokenizer(PROMPT).input_ids
    token_ids = _extra(choice, "token_ids")
    assert len(token_ids) == completion.usage.completion_tokens == 6
    assert tokenizer.decode(token_ids) == choice.text
    plain = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=6, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra and "prompt_token_ids" not in plain.choices[0].model_extra


def test_streamed_token_ids_are_each_chunks_new_ones(stack, client):
    kwargs = dict(model=stack.model_name, prompt=PROMPT, max_tokens=6, temperature=0,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in client.completions.create(**kwargs, stream=True)]
    assert _extra(chunks[0], "prompt_token_ids") == _extra(whole, "prompt_token_ids")
    assert all("prompt_token_ids" not in chunk.model_extra for chunk in chunks[1:])
    assert [token for chunk in chunks for token in _extra(chunk, "token_ids")] == _extra(whole, "token_ids")


def test_chat_returns_the_rendered_conversation_and_output_token_ids(stack, client, tokenizer):
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True})
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert _extra(chat, "prompt_token_ids") == tokenizer(rendered, add_special_tokens=False).input_ids
    token_ids = _extra(chat.choices[0], "token_ids")
    assert tokenizer.decode(token_ids) == chat.choices[0].message.content and len(token_ids) == 5
    chunks = list(client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=5,
                                                 temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert _extra(chunks[0], "prompt_token_ids") == _extra(chat, "prompt_token_ids")
    assert all(chunk.model_extra.get("prompt_token_ids") is None for chunk in chunks[1:])
    assert [token for chunk in chunks for token in _extra(chunk.choices[0], "token_ids")] == token_ids


def test_logprob_tokens_as_token_ids(stack, client):
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    [choice] = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=4, temperature=0,
                                         logprobs=2, extra_body=extra).choices
    assert choice.logprobs.tokens == [f"token_id:{token}" for token in _extra(choice, "token_ids")]
    assert all(len(top) >= 2 and all(key.startswith("token_id:") for key in top)
               for top in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=stack.model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in _extra(chat.choices[0], "token_ids")]
    assert all(top.token.startswith("token_id:") for entry in content for top in entry.top_logprobs)


def test_tokenize_and_detokenize_in_vllm_shapes(stack, tokenizer):
    expected = tokenizer(PROMPT).input_ids
    body = _post(stack, "/tokenize", model=stack.model_name, prompt=PROMPT, return_token_strs=True).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    models = httpx.get(f"{stack.base_url}/models", timeout=10).json()["data"]
    assert body["max_model_len"] == models[0]["max_model_len"]
    assert "token_strs" not in _post(stack, "/tokenize", prompt=PROMPT).json()
    without = _post(stack, "/tokenize", prompt=PROMPT, add_special_tokens=False).json()["tokens"]
    assert without == tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert _post(stack, "/detokenize", model=stack.model_name, tokens=expected).json() == {
        "prompt": tokenizer.decode(expected)}
    assert _post(stack, "/detokenize", tokens=[]).json() == {"prompt": ""}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_renders_chat_messages(stack, tokenizer, add_generation_prompt):
    body = _post(stack, "/tokenize", messages=MESSAGES, add_generation_prompt=add_generation_prompt).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert body["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "tokens": [1]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
])
def test_tokenization_errors_name_the_field(stack, path, body, status, param):
    response = _post(stack, path, **body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_triton_tokenize_only_returns_the_prompt_tokens_without_generating(stack, tokenizer):
    [response], error = grpc_generate(stack, PROMPT, {"max_tokens": 50}, False, tokenize_only=True)
    assert error is None
    ids = tokenizer(PROMPT).input_ids
    assert response.as_numpy("prompt_token_ids").tolist() == ids
    assert [text.decode() for text in response.as_numpy("prompt_token_strs")] == tokenizer.convert_ids_to_tokens(ids)
    assert response.as_numpy("text_output").tolist() == [PROMPT.encode()]
    assert response.as_numpy("finish_reason") is None  # nothing was generated


def test_triton_returns_token_ids_when_asked(stack, tokenizer):
    [response], error = grpc_generate(stack, PROMPT, {"max_tokens": 4, "temperature": 0}, False,
                                      return_token_ids=True, return_prompt_token_ids=True,
                                      exclude_input_in_output=True)
    assert error is None
    assert response.as_numpy("prompt_token_ids").tolist() == tokenizer(PROMPT).input_ids
    [token_ids] = [json.loads(ids) for ids in response.as_numpy("token_ids")]
    assert tokenizer.decode(token_ids) == response.as_numpy("text_output")[0].decode()


# --- chat template controls -----------------------------------------------------------------------------------

PREFILLED = [{"role": "user", "content": "Count from 1 to 10."}, {"role": "assistant", "content": "1, 2, 3,"}]


def _rendered_ids(tokenizer, messages, **controls) -> list[int]:
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, **controls),
                     add_special_tokens=False).input_ids


def _chat(client, stack, messages, **extra):
    return client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


def test_continue_final_message_continues_the_assistant_turn(stack, client, tokenizer):
    controls = {"add_generation_prompt": False, "continue_final_message": True}
    chat = _chat(client, stack, PREFILLED, **controls)
    expected = _rendered_ids(tokenizer, PREFILLED, continue_final_message=True)
    assert _extra(chat, "prompt_token_ids") == expected
    assert chat.choices[0].message.role == "assistant"
    # the same as completing the open-ended rendering
    completion = client.completions.create(model=stack.model_name, prompt=expected, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert _post(stack, "/tokenize", messages=PREFILLED, **controls).json()["tokens"] == expected
    echoed = _chat(client, stack, PREFILLED, echo=True, **controls).choices[0].message.content
    assert echoed == "1, 2, 3," + chat.choices[0].message.content  # vLLM's echo: the continued message first


def test_add_generation_prompt_false_renders_no_assistant_turn(stack, client, tokenizer):
    chat = _chat(client, stack, MESSAGES, add_generation_prompt=False)
    assert _extra(chat, "prompt_token_ids") == _rendered_ids(tokenizer, MESSAGES, add_generation_prompt=False)
    assert chat.choices[0].message.role == "user"  # vLLM's: the role of the message it goes on from


def test_chat_echo_only_repeats_a_message_of_the_answers_role(stack, client):
    plain = _chat(client, stack, MESSAGES).choices[0].message.content
    assert _chat(client, stack, MESSAGES, echo=True).choices[0].message.content == plain  # last message: user's
    streamed = list(client.chat.completions.create(
        model=stack.model_name, messages=PREFILLED, max_tokens=6, temperature=0, stream=True,
        extra_body={"echo": True, "add_generation_prompt": False, "continue_final_message": True}))
    assert streamed[0].choices[0].delta.content.startswith("1, 2, 3,")


def test_chat_template_kwargs_and_add_special_tokens_are_accepted(stack, client, tokenizer):
    chat = _chat(client, stack, MESSAGES, chat_template_kwargs={"enable_thinking": False}, add_special_tokens=True)
    expected = tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)).input_ids
    assert _extra(chat, "prompt_token_ids") == expected


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/chat/completions", {"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("/tokenize", {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
])
def test_conflicting_or_bad_chat_template_controls_are_400(stack, route, fields, param):
    response = _post(stack, route, model=stack.model_name, messages=PREFILLED, max_tokens=1, **fields) \
        if route != "/tokenize" else _post(stack, route, messages=PREFILLED, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# --- /v1/models root, /invocations ----------------------------------------------------------------------------


def test_model_entries_root_the_served_name_or_the_adapter_directory(stack, client):
    models = {model.id: model for model in client.models.list().data}
    base = models[stack.model_name]
    assert _extra(base, "root") == stack.model_name  # SGLang's test_retrieve_model: not a cache path
    adapters = [model for model in models.values() if model.id != stack.model_name]
    assert adapters  # the stack serves the test adapters
    for adapter in adapters:
        name = adapter.id.removeprefix(f"{stack.model_name}:")
        assert _extra(adapter, "root") == str(stack.lora_dir / name) and _extra(adapter, "parent") == stack.model_name
    retrieved = client.models.retrieve(stack.model_name)
    assert retrieved.id == stack.model_name and retrieved.model_extra["root"] == stack.model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("non-existent-model")


def test_invocations_dispatch_by_body_shape(stack, client):
    kwargs = dict(model=stack.model_name, max_tokens=5, temperature=0)
    completion = _post(stack, "/invocations", prompt=PROMPT, **kwargs).json()
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    chat = _post(stack, "/invocations", messages=MESSAGES, **kwargs).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == \
        client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.content
    with httpx.stream("POST", f"{stack.base_url.removesuffix('/v1')}/invocations", timeout=60,
                      json={"messages": MESSAGES, "stream": True, **kwargs}) as response:
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and json.loads(events[0].removeprefix("data: "))["object"] == \
        "chat.completion.chunk"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 5}, "prompt"),
    ({"messages": "hi"}, "messages"),
    ({"prompt": PROMPT, "temperature": 9}, "temperature"),
    ({"prompt": PROMPT, "messagez": []}, "messagez"),
])
def test_invocations_errors_name_the_field(stack, body, param):
    response = _post(stack, "/invocations", model=stack.model_name, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
