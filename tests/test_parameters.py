"""The /v1/completions parameter surface through the whole stack, mostly with the official openai SDK: logprobs
and prompt logprobs against transformers, seeds, logit_bias, penalties, stops and matched_stop, n / best_of,
batches, token-id prompts, usage chunks, and the parameters that are refused."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "The capital of France is"
COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, 10, ..." with " ", digits and "," as separate tokens
REPETITIVE = "I like cats. I like cats. I like cats. I like"
SHORT_ANSWER = "<|im_start|>user\nWhat is 2+2? Answer with a number only.<|im_end|>\n<|im_start|>assistant\n"
"""Greedy: "2 + 2 = 4" then the EOS token (<|im_end|>) after 8 tokens."""
TOLERANCE = 1e-3


class Reference:
    """transformers' float32 run of the same model: token ids, texts, log-probabilities and greedy decoding."""

    def __init__(self, model_dir) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def text(self, token_id: int) -> str:
        """A token's text as the engine reports it in logprobs."""
        return self.tokenizer.decode([token_id])

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int, adjust=None) -> list[int]:
        """Greedy continuation; `adjust(logits, output_ids)` may change each step's logits first."""
        output: list[int] = []
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([prompt_ids + output])).logits[0, -1].float()
            if adjust is not None:
                logits = adjust(logits, output)
            output.append(int(logits.argmax()))
        return output


@pytest.fixture(scope="module")
def ref(default_model_dir) -> Reference:
    return Reference(default_model_dir)


def _offsets(tokens: list[str]) -> list[int]:
    return [0, *accumulate(len(token) for token in tokens)][:-1]


def _matched_stop(choice):
    """SGLang's matched_stop, which must be present (possibly null)."""
    assert "matched_stop" in choice.model_extra, choice
    return choice.model_extra["matched_stop"]


def _streamed(complete, **kwargs) -> tuple[str, object]:
    """A streamed single-choice completion: its text and the one choice chunk that carries its finish_reason."""
    chunks = list(complete(stream=True, **kwargs))
    text = "".join(chunk.choices[0].text for chunk in chunks)
    finishing = [chunk.choices[0] for chunk in chunks if chunk.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    return text, finishing[0]


def _error_of(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    return raised.value


# --- logprobs against transformers ---------------------------------------------------------------------------


def test_completion_logprobs_match_transformers(complete, ref):
    completion = complete(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5)
    [choice] = completion.choices
    logprobs = choice.logprobs
    prompt_ids = ref.ids(PROMPT)
    generated = ref.greedy(prompt_ids, 6)
    assert logprobs.tokens == [ref.text(token_id) for token_id in generated]
    assert choice.text == "".join(logprobs.tokens)
    assert logprobs.text_offset == _offsets(logprobs.tokens)
    rows = ref.logprobs(prompt_ids + generated)[len(prompt_ids) - 1 : -1]
    for position, (token_id, row) in enumerate(zip(generated, rows)):
        assert logprobs.token_logprobs[position] == pytest.approx(row[token_id].item(), abs=TOLERANCE)
        values, ids = row.topk(5)
        expected_top = {ref.text(i): v for i, v in zip(ids.tolist(), values.tolist())}
        assert logprobs.top_logprobs[position] == pytest.approx(expected_top, abs=TOLERANCE)


def _check_prompt_logprobs(logprobs, prompt_ids: list[int], ref: Reference, top: int) -> None:
    count = len(prompt_ids)
    assert logprobs.tokens[:count] == [ref.text(token_id) for token_id in prompt_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = ref.logprobs(prompt_ids)
    for position in range(1, count):
        row = rows[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(row[prompt_ids[position]].item(), abs=TOLERANCE)
        values, ids = row.topk(top)
        expected_top = {ref.text(i): v for i, v in zip(ids.tolist(), values.tolist())}
        expected_top.setdefault(ref.text(prompt_ids[position]), row[prompt_ids[position]].item())  # OpenAI's rule
        assert logprobs.top_logprobs[position] == pytest.approx(expected_top, abs=TOLERANCE)


def test_echo_prompt_logprobs_match_transformers(complete, ref):
    completion = complete(prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3, echo=True)
    [choice] = completion.choices
    logprobs = choice.logprobs
    prompt_ids = ref.ids(PROMPT)
    _check_prompt_logprobs(logprobs, prompt_ids, ref, top=3)
    assert len(logprobs.tokens) == len(prompt_ids) + 3
    assert choice.text.startswith(PROMPT) and choice.text == "".join(logprobs.tokens)
    assert logprobs.text_offset == _offsets(logprobs.tokens)  # the echoed prompt starts at 0
    alone = complete(prompt=PROMPT, max_tokens=3, temperature=0, logprobs=3).choices[0]
    assert choice.text == PROMPT + alone.text
    assert logprobs.token_logprobs[len(prompt_ids) :] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-6)
    assert completion.usage.prompt_tokens == len(prompt_ids) and completion.usage.completion_tokens == 3


def test_echo_scores_the_prompt_with_max_tokens_0(complete, ref):
    """The classic way to score a text: echo its logprobs, generate nothing."""
    [choice] = complete(prompt=PROMPT, max_tokens=0, logprobs=1, echo=True).choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    _check_prompt_logprobs(choice.logprobs, ref.ids(PROMPT), ref, top=1)


def test_streamed_echo_with_logprobs_matches_non_streamed(complete):
    kwargs = dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    whole = complete(**kwargs).choices[0]
    chunks = [chunk.choices[0] for chunk in complete(stream=True, **kwargs)]
    assert chunks[0].text.startswith(PROMPT)  # the prompt goes first, with its logprobs
    assert chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(chunk.text for chunk in chunks) == whole.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [item for chunk in chunks for item in getattr(chunk.logprobs, field)] == getattr(whole.logprobs, field)


# --- seeds, logit_bias, penalties -----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_alone_and_among_other_requests(complete):
    seeded = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234)
    first = complete(**seeded).choices[0].text
    assert complete(**seeded).choices[0].text == first
    others = [dict(prompt=prompt, max_tokens=24, temperature=1.0) for prompt in
              ("Once upon a time", "My favourite food is", "The weather today", "In the year 3000,")]
    with ThreadPoolExecutor(max_workers=len(others) + 2) as pool:
        background = [pool.submit(complete, **kwargs) for kwargs in others]
        during = [pool.submit(lambda: complete(**seeded).choices[0].text),
                  pool.submit(lambda: _streamed(complete, **seeded)[0])]
        assert [future.result() for future in during] == [first, first]
        assert all(future.result().usage.completion_tokens > 0 for future in background)
    assert complete(**{**seeded, "seed": 4321}).choices[0].text != first


def test_logit_bias_forces_or_bans_a_token(complete, ref):
    [cat] = ref.ids(" cat")
    forced = complete(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0, logit_bias={str(cat): 100})
    assert forced.choices[0].logprobs.tokens == [" cat"] * 4

    [comma] = ref.ids(",")
    baseline = complete(prompt=COUNTING, max_tokens=8, temperature=0).choices[0].text
    assert "," in baseline
    banned = complete(prompt=COUNTING, max_tokens=8, temperature=0, logprobs=0, logit_bias={str(comma): -100})
    [choice] = banned.choices
    assert choice.text != baseline
    assert "," not in choice.logprobs.tokens


@pytest.mark.parametrize(
    "penalties",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 1.5}, {"repetition_penalty": 1.5}],
)
def test_penalties_change_greedy_output_as_transformers_with_the_same_rule(complete, ref, penalties):
    prompt_ids = ref.ids(REPETITIVE)
    plain = complete(prompt=REPETITIVE, max_tokens=8, temperature=0).choices[0].text
    penalized = complete(prompt=REPETITIVE, max_tokens=8, temperature=0, extra_body=penalties).choices[0].text
    assert penalized != plain

    frequency = penalties.get("frequency_penalty", 0.0)
    presence = penalties.get("presence_penalty", 0.0)
    repetition = penalties.get("repetition_penalty", 1.0)

    def adjust(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        # Repetition (HF/vLLM rule) covers prompt and output; frequency and presence (OpenAI's) the output only.
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt_ids + output] = True
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - frequency * counts - presence * (counts > 0).float()

    assert penalized == ref.tokenizer.decode(ref.greedy(prompt_ids, 8, adjust))


# --- stops and matched_stop -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, stops, text, finish_reason, matched_stop",
    [
        pytest.param(COUNTING, {"stop": ["7, 8"]}, " 5, 6, ", "stop", "7, 8", id="stop-spanning-tokens"),
        pytest.param(COUNTING, {"stop": [" 5"]}, "", "stop", " 5", id="stop-at-the-start"),
        # both end at the token "7"; the one that starts first wins, whatever the list order
        pytest.param(COUNTING, {"stop": [", 7", "6, 7"]}, " 5, ", "stop", "6, 7", id="overlapping-stops"),
        pytest.param(COUNTING, {"stop": ["7, 8"], "no_stop_trim": True}, " 5, 6, 7, 8", "stop", "7, 8",
                     id="no-stop-trim"),
        pytest.param(COUNTING, {"stop_token_ids": [216]}, "", "stop", 216, id="stop-token-first"),  # " "
        pytest.param(COUNTING, {"stop_token_ids": [40]}, " 5, 6, 7, ", "stop", 40, id="stop-token"),  # "8"
        pytest.param(COUNTING, {"stop_token_ids": [40], "no_stop_trim": True}, " 5, 6, 7, 8", "stop", 40,
                     id="stop-token-no-trim"),
        pytest.param(SHORT_ANSWER, {}, "2 + 2 = 4", "stop", 2, id="eos"),
        pytest.param(COUNTING, {}, " 5, 6, 7, 8, 9", "length", None, id="length"),
        # a stop_regex's matched_stop is its pattern, as in SGLang (whose parameter it is)
        pytest.param(COUNTING, {"stop_regex": r"[7-9]"}, " 5, 6, ", "stop", "[7-9]", id="stop-regex-in-a-token"),
        pytest.param(COUNTING, {"stop_regex": [r"x+", r"7, \d"]}, " 5, 6, ", "stop", r"7, \d",
                     id="stop-regex-spanning-tokens"),
    ],
)
def test_stops_and_matched_stop_streamed_and_not(complete, prompt, stops, text, finish_reason, matched_stop):
    kwargs = dict(prompt=prompt, max_tokens=14, temperature=0, extra_body=stops)
    [choice] = complete(**kwargs).choices
    assert (choice.text, choice.finish_reason, _matched_stop(choice)) == (text, finish_reason, matched_stop)
    streamed_text, finishing = _streamed(complete, **kwargs)
    assert streamed_text == choice.text
    assert (finishing.finish_reason, _matched_stop(finishing)) == (finish_reason, matched_stop)


def test_min_tokens_and_ignore_eos(complete):
    at_eos = complete(prompt=SHORT_ANSWER, max_tokens=16, temperature=0)
    assert at_eos.choices[0].finish_reason == "stop" and at_eos.usage.completion_tokens < 10
    held = complete(prompt=SHORT_ANSWER, max_tokens=16, temperature=0, extra_body={"min_tokens": 12})
    assert held.usage.completion_tokens >= 12
    ignored = complete(prompt=SHORT_ANSWER, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    [choice] = ignored.choices
    assert (choice.finish_reason, _matched_stop(choice), ignored.usage.completion_tokens) == ("length", None, 12)
    assert choice.text.startswith(at_eos.choices[0].text)


# --- n, best_of, batches, token ids ---------------------------------------------------------------------------


def test_best_of_returns_the_n_most_likely_of_its_candidates(complete):
    kwargs = dict(prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7, logprobs=0)
    candidates = complete(n=3, **kwargs).choices
    assert [choice.index for choice in candidates] == [0, 1, 2]
    best = complete(n=2, best_of=3, **kwargs)
    assert [choice.index for choice in best.choices] == [0, 1]
    likelihood = {choice.text: sum(choice.logprobs.token_logprobs) for choice in candidates}
    assert {choice.text for choice in best.choices} == set(sorted(likelihood, key=likelihood.get)[-2:])
    assert all(choice.finish_reason == "length" and _matched_stop(choice) is None for choice in best.choices)


def test_streamed_best_of_above_n_is_400(complete):
    error = _error_of(lambda: complete(prompt=PROMPT, n=1, best_of=2, stream=True))
    assert error.status_code == 400 and error.param == "best_of"


def test_batch_with_n_is_prompt_major(complete):
    prompts = [PROMPT, COUNTING]
    alone = [complete(prompt=prompt, max_tokens=5, temperature=0).choices[0].text for prompt in prompts]
    batch = complete(prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [(choice.index, choice.text) for choice in batch.choices] == [
        (0, alone[0]), (1, alone[0]), (2, alone[1]), (3, alone[1])]
    assert batch.usage.completion_tokens == 20


def test_token_id_prompts(complete, ref):
    prompts = [PROMPT, COUNTING]
    ids = [ref.ids(prompt) for prompt in prompts]
    alone = [complete(prompt=prompt, max_tokens=5, temperature=0).choices[0].text for prompt in prompts]
    single = complete(prompt=ids[0], max_tokens=5, temperature=0)
    assert single.choices[0].text == alone[0] and single.usage.prompt_tokens == len(ids[0])
    batch = complete(prompt=ids, max_tokens=5, temperature=0)
    assert [choice.text for choice in batch.choices] == alone
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    # echo gives the decoded prompt, with logprobs as for the same prompt given as text
    echoed = complete(prompt=ids, max_tokens=5, temperature=0, echo=True)
    assert [choice.text for choice in echoed.choices] == [prompt + text for prompt, text in zip(prompts, alone)]
    assert all(choice.logprobs is None for choice in echoed.choices)
    scored = dict(max_tokens=2, temperature=0, echo=True, logprobs=2)
    assert complete(prompt=ids[0], **scored).choices == complete(prompt=PROMPT, **scored).choices


# --- usage chunks and refused parameters ----------------------------------------------------------------------

CHUNK_FIELDS = {"id", "object", "created", "model", "choices"}
CHOICE_FIELDS = {"index", "text", "logprobs", "finish_reason", "matched_stop"}
USAGE_FIELDS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


def _sse_chunks(stack, **body) -> list[dict]:
    """The JSON chunks of a streamed completion, as they are on the wire."""
    with httpx.stream("POST", f"{stack.base_url}/completions", json={"model": stack.model_name, **body},
                      timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def _check_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert set(usage) == USAGE_FIELDS and set(usage["prompt_tokens_details"]) == {"cached_tokens"}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, completion_tokens)
    assert usage["total_tokens"] == prompt_tokens + completion_tokens


@pytest.mark.parametrize("continuous", [False, True])
def test_include_usage_and_continuous_usage_stats_chunks(stack, complete, ref, continuous):
    options = {"include_usage": True, "continuous_usage_stats": continuous}
    body = dict(prompt=COUNTING, max_tokens=6, temperature=0, ignore_eos=True, stream=True, stream_options=options)
    chunks = _sse_chunks(stack, **body)
    prompt_tokens = len(ref.ids(COUNTING))
    *content, last = chunks
    assert len({chunk["id"] for chunk in chunks}) == 1
    for chunk in content:
        assert set(chunk) == CHUNK_FIELDS | ({"usage"} if continuous else set())
        assert chunk["object"] == "text_completion" and chunk["model"] == stack.model_name
        [choice] = chunk["choices"]
        assert set(choice) == CHOICE_FIELDS and choice["index"] == 0 and choice["logprobs"] is None
    assert [chunk["choices"][0]["finish_reason"] for chunk in content][-1] == "length"
    assert content[-1]["choices"][0]["matched_stop"] is None
    if continuous:
        completed = [chunk["usage"]["completion_tokens"] for chunk in content]
        assert completed == sorted(completed) and completed[-1] == 6
        for chunk in content:
            _check_usage(chunk["usage"], prompt_tokens, chunk["usage"]["completion_tokens"])
    assert set(last) == CHUNK_FIELDS | {"usage"} and last["choices"] == []
    _check_usage(last["usage"], prompt_tokens, 6)
    # the SDK reads the same stream
    sdk_chunks = list(complete(prompt=COUNTING, max_tokens=6, temperature=0, stream=True, stream_options=options,
                               extra_body={"ignore_eos": True}))
    assert all((chunk.usage is not None) == continuous for chunk in sdk_chunks[:-1])
    assert sdk_chunks[-1].usage.completion_tokens == 6 and sdk_chunks[-1].choices == []


def test_suffix_is_refused(complete):
    error = _error_of(lambda: complete(prompt=PROMPT, suffix=" and that is all."))
    assert error.param == "suffix" and "fill-in-the-middle" in error.message


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"12": 150}}, "logit_bias"),
        ({"logit_bias": {"ab": 1}}, "logit_bias"),
        ({"stop_regex": "(oops"}, "stop_regex"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"echo": "yes please"}, "echo"),
        ({"lora_path": "../outside"}, "lora_path"),
        ({"return_routed_experts": True}, "return_routed_experts"),
    ],
)
def test_out_of_range_values_are_400_naming_the_parameter(stack, fields, param):
    response = httpx.post(f"{stack.base_url}/completions",
                          json={"model": stack.model_name, "prompt": PROMPT, **fields}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_user_is_accepted(complete):
    assert complete(prompt=PROMPT, max_tokens=1, user="user-1234").choices[0].finish_reason == "length"
