"""Beam search (`use_beam_search`) through LLMEngine against transformers' `generate(num_beams=...)` in float32 on a
tiny random Llama: the same beams token for token, scores close; beams batched with other requests; every KV
block back once beam requests end, cancelled ones included; the combinations it refuses."""

from __future__ import annotations

import pytest
import torch

from tritonllm.engine.llm_engine import Request
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from engine_helpers import Result, generate

PROMPTS = ["The capital of France is", "Write a short story about a lighthouse keeper and a storm."]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def model_type() -> str:
    return "llama"


def _choices(result: Result, n: int) -> list[tuple[list[int], float, str]]:
    """Each returned beam's (tokens, cumulative logprob, finish reason), best first."""
    last = {c.index: c for o in result.outputs for c in o.choices}
    return [(result.token_ids(i), last[i].cumulative_logprob, last[i].finish_reason) for i in range(n)]


def _reference(model, prompt_ids: list[int], width: int, n: int, length_penalty: float, early_stopping: bool,
               eos: int | None) -> list[tuple[list[int], float]]:
    """transformers' beams: (generated tokens up to and with the EOS that ended one, score), best first."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, num_beams=width,
                             num_return_sequences=n, length_penalty=length_penalty, early_stopping=early_stopping,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
    beams = []
    for row, beam_score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        generated = row[len(prompt_ids):]
        if eos is not None and eos in generated:
            generated = generated[:generated.index(eos) + 1]
        beams.append((generated, beam_score))
    return beams


def _stop_token(engine, prompt: str) -> int:
    """A token the model makes early after `prompt` (greedy's 3rd): as the EOS of both sides, beams end on it."""
    [result] = generate(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    return result.token_ids()[2]


@pytest.mark.parametrize("width, n, length_penalty, early_stopping, with_eos", [
    (4, 4, 1.0, False, False),
    (3, 2, 1.0, False, True),
    (4, 2, 0.0, False, True),
    (4, 3, 2.0, True, True),
    (5, 1, -1.0, False, True),
])
def test_beams_equal_transformers(tiny_engine, tiny_reference, width, n, length_penalty, early_stopping, with_eos):
    eos = {prompt: _stop_token(tiny_engine, prompt) if with_eos else None for prompt in PROMPTS}
    params = [SamplingParams(use_beam_search=True, n=n, best_of=width, max_tokens=MAX_TOKENS, ignore_eos=True,
                             stop_token_ids=[] if eos[prompt] is None else [eos[prompt]],
                             length_penalty=length_penalty, early_stopping=early_stopping)
              for prompt in PROMPTS]
    results = generate(tiny_engine, PROMPTS, params)  # both at once: one's beams fork while the other prefills
    ended_on_eos = 0
    for result in results:
        prompt = result.request.prompt
        expected = _reference(tiny_reference, tiny_engine.tokenizer.encode(prompt), width, n, length_penalty,
                              early_stopping, eos[prompt])
        ours = _choices(result, n)
        assert [tokens for tokens, _, _ in ours] == [tokens for tokens, _ in expected]
        for (tokens, cumulative, reason), (_, reference_score) in zip(ours, expected):
            assert cumulative / len(tokens) ** length_penalty == pytest.approx(reference_score, abs=1e-4)
            assert reason == ("stop" if tokens[-1] == eos[prompt] else "length")
            ended_on_eos += reason == "stop"
    assert ended_on_eos or not with_eos  # the EOS rules were exercised


def _record_batches(engine, monkeypatch) -> list[list[str]]:
    """Each step's batch: the request id of each of its sequences."""
    batches, execute = [], engine.core.runner.execute

    def recording(scheduled):
        batches.append([item.seq.request.request_id for item in scheduled])
        return execute(scheduled)

    monkeypatch.setattr(engine.core.runner, "execute", recording)
    return batches


def test_beams_run_in_the_batch_with_other_requests_and_free_every_block(tiny_engine, monkeypatch):
    core = tiny_engine.core
    start = core.block_manager.num_free_blocks
    batches = _record_batches(tiny_engine, monkeypatch)
    beam = SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=12, ignore_eos=True)
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    beam_result, plain_result = generate(tiny_engine, PROMPTS, [beam, plain])
    ids = {beam_result.request.request_id, plain_result.request.request_id}
    together = [batch for batch in batches if ids <= set(batch)]
    assert len(together) >= 10  # decoded side by side, step after step
    [alone] = generate(tiny_engine, [PROMPTS[1]], plain)
    assert plain_result.token_ids() == alone.token_ids()  # the beams beside it changed nothing
    assert len(_choices(beam_result, 2)) == 2
    assert core.block_manager.num_free_blocks == start
    assert all(count == 0 for count in core.block_manager.ref_counts)


def test_cancelled_beam_request_frees_its_blocks(tiny_engine):
    core = tiny_engine.core
    start = core.block_manager.num_free_blocks
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=40, ignore_eos=True)
    tiny_engine.add_request(Request("beams-to-cancel", PROMPTS[1], params))
    outputs = []
    for _ in range(6):  # past the first forks
        outputs += tiny_engine.step()
    assert len(core._requests["beams-to-cancel"].sequences) == 3
    assert core.block_manager.num_free_blocks < start
    tiny_engine.abort_request("beams-to-cancel")
    outputs += tiny_engine.step()
    assert [c.finish_reason for o in outputs for c in o.choices] == ["abort"] * 3 and outputs[-1].finished
    assert not tiny_engine.has_unfinished_requests()
    assert core.block_manager.num_free_blocks == start
    assert all(count == 0 for count in core.block_manager.ref_counts)


@pytest.mark.parametrize("values, param", [
    ({"stop": ["."]}, "stop"),
    ({"json_schema": '{"type": "object"}'}, "json_schema"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_what_beam_search_refuses(values, param):
    with pytest.raises(InvalidRequest) as refused:
        SamplingParams.from_dict({"use_beam_search": True, **values})
    assert refused.value.param == param
    SamplingParams.from_dict(values)  # fine without beam search
    SamplingParams.from_dict({"use_beam_search": True, "temperature": 0.7, "top_p": 0.5})  # as vLLM: no part in it
    with pytest.raises(InvalidRequest, match="cannot be streamed"):
        SamplingParams.from_dict({"use_beam_search": True}).check_streamable()


def test_beams_stay_within_max_num_seqs(tiny_engine, tiny_dir, monkeypatch):
    """Forks beyond the batch's max_num_seqs wait first in line; the beams come out the same."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.llm_engine import LLMEngine
    from engine_helpers import EXACT
    small = LLMEngine(EngineConfig(model_path=str(tiny_dir), **EXACT, kv_cache_memory=4 << 20, block_size=4,
                                   max_num_batched_tokens=16, max_num_seqs=3))
    batches = _record_batches(small, monkeypatch)
    beam = SamplingParams(use_beam_search=True, n=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ours, _ = generate(small, PROMPTS, [beam, plain])
    [reference] = generate(tiny_engine, [PROMPTS[0]], beam)
    assert [tokens for tokens, _, _ in _choices(ours, 3)] == [tokens for tokens, _, _ in _choices(reference, 3)]
    assert max(map(len, batches)) == 3
    assert small.core.block_manager.num_free_blocks == small.core.block_manager.num_blocks
    with pytest.raises(InvalidRequest, match="max-num-seqs"):
        small.add_request(Request("too-wide", PROMPTS[0], SamplingParams(use_beam_search=True, n=2, best_of=4)))
