"""The engine driven directly (no Triton): batching, stops, detokenization, seeds, aborts, prefix cache,
preemption, admission errors. Greedy references come from transformers' generate."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.core_loop import CoreLoop
from tritonllm.engine.core.step_pacer import StepPacer
from tritonllm.interface.errors import InvalidRequest
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import LLMEngine, Request
from engine_helpers import EXACT, assert_idle, generate

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
PROMPTS = [
    "The capital of France is",
    "Write a poem about the sea. " * 12,  # longer than one prefill chunk below
    "1, 2, 3, 4,",
    "def add(a, b):",
    "The quick brown fox",
    "Explain photosynthesis in simple terms. " * 6,
]


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=64 << 20,
                                  max_num_batched_tokens=48))


def test_greedy_matches_transformers_generate(engine, default_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = hf_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
    [result] = generate(engine, [prompt], GREEDY)
    assert result.token_ids() == expected
    assert result.text().startswith(" Paris")
    assert result.finish_reason() == ("stop" if expected[-1] in engine.core.eos_token_ids else "length")
    assert_idle(engine)


def test_paced_prompt_chunks_shrink_beside_decodes_and_change_no_output(engine, monkeypatch):
    """With the pacer on (max_decode_slowdown, step_pacer.py) and its measurements given, a long prompt arriving
    while a request decodes is prefilled in chunks within the pacer's budget, not the step's 48 tokens; every
    output is still each request's alone (float32 prompts: chunking changes no bit)."""
    pacer = StepPacer(2.0)
    pacer.decode_seconds, pacer.seconds_per_unit = 0.020, 0.020 / 20  # 20 units of prompt work a step
    monkeypatch.setattr(pacer, "observe", lambda *args: None)  # kept as given, whatever the steps take
    monkeypatch.setattr(engine.core, "pacer", pacer)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    short, long = "The quick brown fox", "Item 9: " + "a list of colors, " * 30
    decoding = Request("paced-short", short, params)  # (first: the prompts are not yet cached)
    engine.add_request(decoding)
    outputs = {"paced-short": [], "paced-long": []}
    while not engine.core.scheduler.running or engine.core.scheduler.running[0].num_output_tokens == 0:
        for output in engine.step():
            outputs[output.request_id].append(output)
    engine.add_request(Request("paced-long", long, params))
    chunks = []
    while engine.has_unfinished_requests():
        seq = next((s for s in engine.core.scheduler.running if s.request.request_id == "paced-long"), None)
        computed = seq.num_computed_tokens if seq else 0
        for output in engine.step():
            outputs[output.request_id].append(output)
        seq = next((s for s in engine.core.scheduler.running if s.request.request_id == "paced-long"), seq)
        if seq.num_output_tokens == 0:
            chunks.append(seq.num_computed_tokens - computed)
    assert len(chunks) > 2 and max(chunks) <= 20  # (47 a step unpaced)
    together = [[t for o in outputs[name] for c in o.choices for t in c.token_ids] for name in outputs]
    assert together == [generate(engine, [prompt], params)[0].token_ids() for prompt in (short, long)]
    assert_idle(engine)


def test_sixteen_concurrent_greedy_requests_equal_each_alone(engine):
    # lengths from 3 to ~120 tokens; several exceed the engine's 48-token step budget, so they prefill in chunks
    prompts = PROMPTS + [f"Item {i}: " + "a list of colors, " * (i * 2) for i in range(10)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = [generate(engine, [p], params)[0].token_ids() for p in prompts]
    together = [r.token_ids() for r in generate(engine, prompts, params)]
    assert together == alone
    assert_idle(engine)


def test_streamed_deltas_never_split_characters(engine):
    prompts = ["Translate to Japanese: good morning, my friend. ->", "Some emoji for a party: 🎉", "中文：你好，"]
    for result in generate(engine, prompts, SamplingParams(max_tokens=24, temperature=0.0)):
        deltas = result.deltas()
        assert all("\ufffd" not in d for d in deltas)
        tokenizer = engine.tokenizer
        full = tokenizer.decode(result.token_ids(), skip_special_tokens=True)
        assert "".join(deltas) == full.rstrip("\ufffd")


def test_stop_string_spanning_tokens_is_trimmed_and_never_streamed(engine):
    [free] = generate(engine, ["1, 2, 3, 4,"], GREEDY)
    text = free.text()
    assert " 7, 8" in text  # the model counts: the stop below spans several tokens
    stop = " 7, 8"
    [result] = generate(engine, ["1, 2, 3, 4,"], SamplingParams(max_tokens=32, temperature=0.0, stop=[stop]))
    assert result.text() == text[:text.index(stop)]
    assert result.finish_reason() == "stop"
    streamed = ""
    for delta in result.deltas():
        streamed += delta
        assert stop not in streamed and not any(streamed.endswith(stop[:k]) for k in range(2, len(stop)))


def test_stop_at_first_token_and_overlapping_stops(engine):
    [free] = generate(engine, ["1, 2, 3, 4,"], GREEDY)
    first = free.text()[:2]  # " 5"
    [result] = generate(engine, ["1, 2, 3, 4,"], SamplingParams(max_tokens=8, temperature=0.0, stop=[first]))
    assert result.text() == "" and result.finish_reason() == "stop"
    [result] = generate(engine, ["1, 2, 3, 4,"],
                        SamplingParams(max_tokens=32, temperature=0.0, stop=[" 6, 7, 9", " 6, 7"]))
    assert result.text() == free.text()[:free.text().index(" 6, 7")]


def test_stop_token_ids_and_eos(engine):
    [free] = generate(engine, ["1, 2, 3, 4,"], GREEDY)
    tokens = free.token_ids()
    first_new = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    [result] = generate(engine, ["1, 2, 3, 4,"], SamplingParams(max_tokens=32, temperature=0.0,
                                                               stop_token_ids=[tokens[first_new]]))
    assert result.token_ids() == tokens[:first_new + 1] and result.finish_reason() == "stop"
    [chat] = generate(engine, ["<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"],
                      SamplingParams(max_tokens=64, temperature=0.0))
    assert chat.finish_reason() == "stop" and chat.token_ids()[-1] in engine.core.eos_token_ids
    assert "<|im_end|>" not in chat.text()


def test_min_tokens_and_ignore_eos(engine):
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    [short] = generate(engine, [prompt], SamplingParams(max_tokens=64, temperature=0.0))
    n = len(short.token_ids())
    [longer] = generate(engine, [prompt], SamplingParams(max_tokens=64, temperature=0.0, min_tokens=n + 3))
    assert len(longer.token_ids()) >= n + 3
    [ignored] = generate(engine, [prompt], SamplingParams(max_tokens=n + 5, temperature=0.0, ignore_eos=True))
    assert len(ignored.token_ids()) == n + 5 and ignored.finish_reason() == "length"


def test_seeded_sampling_is_reproducible_whatever_runs_beside(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234, n=2)
    [alone] = generate(engine, ["Tell me a story"], params)
    busy = generate(engine, ["Tell me a story", "Another prompt here", "More load"],
                    [params, SamplingParams(max_tokens=30, temperature=0.8), GREEDY])
    assert [busy[0].token_ids(i) for i in range(2)] == [alone.token_ids(i) for i in range(2)]
    assert alone.token_ids(0) != alone.token_ids(1)  # each choice has its own stream
    [other] = generate(engine, ["Tell me a story"], SamplingParams(max_tokens=20, temperature=1.0, seed=99))
    assert other.token_ids() != alone.token_ids()


def test_abort_frees_blocks_and_reports_abort(engine):
    request = Request("to-abort", "Write a long essay about rivers.", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert engine.stats().running == 1
    engine.abort_request("to-abort")
    outputs = engine.step()
    assert [c.finish_reason for o in outputs for c in o.choices] == ["abort"] and outputs[-1].finished
    assert_idle(engine)


@pytest.fixture(scope="module")
def small_uncached_engine(default_model_dir, engine) -> LLMEngine:
    """13 blocks of 16 tokens: far too few for the six PROMPTS at once, enough for each alone."""
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT,
                                  kv_cache_memory=13 * engine.core.runner.bytes_per_block,
                                  max_num_batched_tokens=48, enable_prefix_caching=False))


def test_prefix_cache_reuses_blocks_and_keeps_output(engine, small_uncached_engine):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 5
    [uncached] = generate(small_uncached_engine, [shared + "What is 2+2?"], GREEDY)
    [first] = generate(engine, [shared + "What is 2+2?"], GREEDY)
    [second] = generate(engine, [shared + "What is 2+2?"], GREEDY)
    assert second.outputs[-1].num_cached_tokens >= 16 * ((first.outputs[-1].num_prompt_tokens - 1) // 16)
    assert second.token_ids() == first.token_ids() == uncached.token_ids()
    assert engine.stats().prefix_cache_hit_rate > 0
    assert_idle(engine)


def test_preemption_keeps_greedy_outputs(engine, small_uncached_engine):
    expected = [r.token_ids() for r in generate(engine, PROMPTS, GREEDY)]
    small = small_uncached_engine
    results = generate(small, PROMPTS, GREEDY)
    assert small.stats().preemptions > 0
    assert [r.token_ids() for r in results] == expected
    assert_idle(small)


def test_admission_errors(engine):
    too_long = Request("long", [1] * 9000, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="at most"):
        engine.add_request(too_long)
    with pytest.raises(InvalidRequest, match="context length"):
        engine.add_request(Request("over", "hello", SamplingParams(max_tokens=8190)))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        engine.add_request(Request("vocab", [10**6], SamplingParams()))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request(Request("empty", "", SamplingParams()))
    [zero] = generate(engine, ["Hello"], SamplingParams(max_tokens=0))
    assert zero.text() == "" and zero.finish_reason() == "length" and zero.token_ids() == []
    [scored] = generate(engine, ["Hello there"], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert scored.token_ids() == [] and [e.token_id for e in scored.outputs[0].prompt_logprobs] == \
        engine.tokenizer.encode("Hello there")
    assert_idle(engine)


def test_prompt_logprobs_match_transformers_across_prefill_chunks(engine, default_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[1]  # longer than the 48-token step budget: computed over several chunks
    ids = engine.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for _ in range(2):  # the second time the prompt is in the prefix cache, which must not be used
        [result] = generate(engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))
        entries = result.outputs[0].prompt_logprobs
        assert len(entries) == len(ids) and entries[0].logprob is None and entries[0].token_id == ids[0]
        for position, entry in enumerate(entries[1:], start=1):
            assert entry.token_id == ids[position]
            assert abs(entry.logprob - expected[position - 1, ids[position]].item()) <= 1e-3
            top_ids = [token_id for token_id, _, _ in entry.top]
            assert top_ids == expected[position - 1].topk(3).indices.tolist()
        assert all(o.prompt_logprobs is None for o in result.outputs[1:])  # sent once


def test_logit_bias_forces_and_bans_tokens(engine):
    [free] = generate(engine, ["The capital of France is"], SamplingParams(max_tokens=6, temperature=0.0))
    forced_id = engine.tokenizer.encode(" banana")[0]
    [forced] = generate(engine, ["The capital of France is"],
                        SamplingParams(max_tokens=6, temperature=0.0, logit_bias={forced_id: 100.0}))
    assert forced.token_ids() == [forced_id] * 6
    banned = free.token_ids()[0]
    [without] = generate(engine, ["The capital of France is"],
                         SamplingParams(max_tokens=6, temperature=0.9, seed=3, logit_bias={banned: -100.0}))
    assert banned not in without.token_ids()


def test_penalties_change_repetitive_output(engine):
    prompt = "Write the word hello ten times: hello hello"  # greedy repeats " hello" to the end
    base = SamplingParams(max_tokens=16, temperature=0.0)
    [plain] = generate(engine, [prompt], base)
    hello = plain.token_ids()[0]
    assert plain.token_ids() == [hello] * 16
    for change in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.0}, {"repetition_penalty": 1.5}):
        [penalized] = generate(engine, [prompt], SamplingParams(**{**base.__dict__, **change}))
        assert penalized.token_ids().count(hello) <= 2, change


def test_stop_regex_no_stop_trim_and_matched_stop(engine):
    prompt = "1, 2, 3, 4,"
    [free] = generate(engine, [prompt], GREEDY)
    text = free.text()
    [regex] = generate(engine, [prompt], SamplingParams(max_tokens=32, temperature=0.0, stop_regex=[r"\b7\b"]))
    assert regex.text() == text[:text.index("7")] and regex.finish_reason() == "stop"
    assert regex.outputs[-1].choices[-1].matched_stop == r"\b7\b"  # the pattern, as SGLang
    [kept] = generate(engine, [prompt], SamplingParams(max_tokens=32, temperature=0.0, stop=[" 7,"], no_stop_trim=True))
    assert kept.text() == text[:text.index(" 7,") + 3]
    assert kept.outputs[-1].choices[-1].matched_stop == " 7,"
    [length] = generate(engine, [prompt], SamplingParams(max_tokens=3, temperature=0.0))
    assert length.outputs[-1].choices[-1].matched_stop is None


def test_a_request_failing_in_its_own_processing_fails_alone(engine, monkeypatch):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [expected] = generate(engine, ["The quick brown fox"], params)
    original = engine.outputs._apply
    updates = {"sick": 0}

    def fragile(state_params, choice, update):
        if state_params is sick_params:
            updates["sick"] += 1
            if updates["sick"] == 3:
                raise RuntimeError("detokenizer exploded")
        return original(state_params, choice, update)

    sick_params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(engine.outputs, "_apply", fragile)
    requests = [Request("healthy", "The quick brown fox", params), Request("sick", "poison", sick_params)]
    for request in requests:
        engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    [error] = [o for o in outputs if o.error is not None]
    assert error.request_id == "sick" and error.finished and "exploded" in str(error.error)
    healthy = [t for o in outputs if o.request_id == "healthy" for c in o.choices for t in c.token_ids]
    assert healthy == expected.token_ids()
    assert_idle(engine)


def test_core_loop_shutdown_aborts_what_does_not_finish_in_time(engine):
    outputs = []
    loop = CoreLoop(outputs.extend)
    loop.start(lambda: engine.core)
    loop.submit(engine.inputs.process("long", "Tell me a story.", SamplingParams(max_tokens=500, ignore_eos=True)))
    while not outputs:
        time.sleep(0.01)
    loop.shutdown(timeout=0.2)
    assert outputs[-1].finished and outputs[-1].sequences[-1].finish_reason == "abort"
    assert_idle(engine)


ENGINE_WITHOUT_TRITON = """
import sys

import torch
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine, Request
from tritonllm.interface.parameters import SamplingParams
from tritonllm.kernels.rms_norm import rms_norm_triton

engine = LLMEngine(EngineConfig(model_path=sys.argv[1], kv_cache_memory=64 << 20, max_num_seqs=4))
every_sampling_op = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=40, min_p=0.05,
                                   repetition_penalty=1.2, presence_penalty=0.5, logit_bias={42: 5.0},
                                   regex="[a-z ]+")
engine.add_request(Request("every-op", "Tell me a story.", every_sampling_op))
finished = False
while engine.has_unfinished_requests():
    finished |= any(output.finished for output in engine.step())
modules = sorted(name for name in sys.modules if name == "triton" or name.startswith("triton."))
try:  # a kernel launched anyway says why it cannot run here
    rms_norm_triton(torch.ones(1, 8), torch.ones(8), 1e-6)
    refused = False
except RuntimeError as error:
    refused = "TRITON_INTERPRET=1" in str(error)
print(finished, refused, modules)
"""


def test_a_cpu_engine_serves_every_sampling_op_without_importing_openai_triton(default_model_dir):
    """Its kernels cannot launch here; importing its compiler would cost each engine process ~70 MiB resident."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU host wherever this runs
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", ENGINE_WITHOUT_TRITON, str(default_model_dir)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "True True []"
