"""LoRA adapters, hidden states and routed experts in the engine (no Triton). References: transformers with the
adapter's B @ A * scale merged into its weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import Request
from tritonllm.interface.errors import InvalidRequest, NotFound
from tritonllm.engine.processing.lora_files import read_float32_safetensors
from engine_helpers import EXACT, TorchOps, generate
from lora_helpers import merged_model, write_random_adapter

PROMPT = "The capital of France is"
LONG_PROMPT = "Write a short story about a lighthouse keeper and a storm. " * 4  # several KV blocks


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("adapters")
    write_random_adapter(root / "alpha", default_model_dir, seed=1)
    write_random_adapter(root / "beta", default_model_dir, seed=2, rank=4, alpha=8.0, std=0.05)
    write_random_adapter(root / "team" / "gamma", default_model_dir, seed=3, targets=("q_proj", "v_proj"))
    return root


@pytest.fixture(scope="module")
def engine(default_model_dir, adapters_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=64 << 20,
                                  max_num_batched_tokens=256, lora_dir=str(adapters_dir), max_loras=2,
                                  max_lora_rank=8, max_hidden_states_tokens=200))


def _abort_all(engine: LLMEngine) -> None:
    engine.abort_all()
    engine.step()
    stats = engine.stats()
    assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.total_blocks


def test_mixed_batch_logits_match_merged_references(engine, default_model_dir, adapters_dir):
    tokenizer = engine.tokenizer
    prompt_ids = tokenizer.encode(PROMPT)
    choices = {"alpha": adapters_dir / "alpha", None: None, "team/gamma": adapters_dir / "team" / "gamma"}
    requests = [Request(f"mixed-{i}", prompt_ids, SamplingParams(max_tokens=4, temperature=0.0, lora_path=name))
                for i, name in enumerate(choices)]
    for request in requests:
        engine.add_request(request)
    engine.step()  # prefill of all three together, each samples its first token
    decode = engine.core.runner.execute(engine.core.scheduler.schedule())  # then one decode step, again batched
    assert [seq.request.request_id for seq in decode.sample_seqs] == [request.request_id for request in requests]
    base_logits = None
    for row, (request, adapter_dir) in enumerate(zip(requests, choices.values())):
        tokens = torch.tensor([decode.sample_seqs[row].token_ids])
        with torch.no_grad():
            expected = merged_model(default_model_dir, adapter_dir)(tokens).logits[0, -1]
        difference = (decode.logits[row] - expected).abs().max().item()
        print(f"lora {request.params.lora_path}: max |Δlogit| vs merged reference = {difference:.2e}")
        assert difference < 1e-3
        if adapter_dir is None:
            base_logits = expected
    assert (decode.logits[0] - base_logits).abs().max() > 0.5  # the adapter really changes the output
    _abort_all(engine)


def test_more_adapters_than_slots_wait_and_evict_least_recently_used(engine):
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora_path=name)
              for name in ("alpha", "beta", "team/gamma", None)]
    alone = [generate(engine, [PROMPT], p)[0].token_ids() for p in params]
    assert engine.stats().loaded_loras == ("beta", "team/gamma")  # alpha, least recently used, went first
    together = [r.token_ids() for r in generate(engine, [PROMPT] * 4, params)]  # 3 adapters, 2 slots: one waits
    assert together == alone
    assert alone[0] != alone[3] and alone[1] != alone[3]  # adapters alpha and beta change the greedy text
    assert engine.core.runner.lora_slots.pins == [0, 0]


def test_prefix_cache_is_not_shared_across_adapters(engine):
    params = {name: SamplingParams(max_tokens=1, temperature=0.0, lora_path=name) for name in ("alpha", "beta")}

    def cached(p) -> int:
        return generate(engine, [LONG_PROMPT], p)[0].outputs[-1].num_cached_tokens

    base = SamplingParams(max_tokens=1)
    cached(base)
    assert cached(base) > 0  # the base model's KV of the prompt is cached, and reused by the base
    assert cached(params["alpha"]) == 0
    assert cached(params["alpha"]) > 0  # the same adapter reuses its own KV
    assert cached(params["beta"]) == 0


@pytest.mark.parametrize("lora_path", ["../alpha", "/etc", "team/../../x", "escape"])
def test_paths_outside_the_adapters_directory_are_refused(engine, adapters_dir, tmp_path, lora_path):
    (adapters_dir / "escape").unlink(missing_ok=True)
    (adapters_dir / "escape").symlink_to(tmp_path)  # a link out of the directory
    write_random_adapter(tmp_path, engine.parts.model_dir, seed=9, targets=("q_proj",))
    with pytest.raises(InvalidRequest, match="not inside the adapters directory") as error:
        engine.add_request(Request(f"escape-{lora_path}", PROMPT, SamplingParams(lora_path=lora_path)))
    assert error.value.param == "lora_path"


@pytest.mark.parametrize("lora_path", ["nope", "bad\x00name", "caf\u00e9\udcb6"])
def test_unknown_adapter_is_not_found(engine, lora_path):
    """Names no file can have (a NUL, a lone surrogate) are simply not found, never an internal error."""
    with pytest.raises(NotFound, match="no LoRA adapter") as error:
        engine.add_request(Request(f"unknown-adapter-{len(lora_path)}", PROMPT, SamplingParams(lora_path=lora_path)))
    assert str(error.value).startswith("[not_found:lora_path]")


def test_adapter_of_too_high_a_rank_is_refused(engine, adapters_dir):
    write_random_adapter(adapters_dir / "wide", engine.parts.model_dir, seed=4, rank=16, targets=("o_proj",))
    with pytest.raises(InvalidRequest, match="max_lora_rank=8"):
        engine.add_request(Request("wide-adapter", PROMPT, SamplingParams(lora_path="wide")))


def test_hidden_states_match_transformers_last_hidden_state(engine, default_model_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_hidden_states=True,
                            return_prompt_hidden_states=True)
    [result] = generate(engine, [PROMPT], params)
    generated = torch.stack([row for output in result.outputs for choice in output.choices
                             for row in choice.hidden_states])
    prompt = next(o.prompt_hidden_states for o in result.outputs if o.prompt_hidden_states is not None)
    prompt_ids = engine.tokenizer.encode(PROMPT)
    sequence, num_prompt = prompt_ids + result.token_ids(), len(prompt_ids)
    assert generated.shape == (6, 576) and prompt.shape == (num_prompt, 576)
    with torch.no_grad():
        expected = merged_model(default_model_dir, None).model(torch.tensor([sequence])).last_hidden_state[0]
    # prompt rows: each prompt position; generated rows: the position whose logits produced the token
    torch.testing.assert_close(prompt, expected[:num_prompt], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(generated, expected[num_prompt - 1:-1], atol=1e-3, rtol=1e-3)


def test_hidden_states_beyond_the_bound_are_refused(engine):
    with pytest.raises(InvalidRequest, match="max_hidden_states_tokens is 200"):
        engine.add_request(Request("too-many-hidden", PROMPT,
                                   SamplingParams(max_tokens=100, n=3, return_hidden_states=True)))


def test_routed_experts_on_a_dense_model_is_refused(engine):
    with pytest.raises(InvalidRequest, match="no experts") as error:
        engine.add_request(Request("experts", PROMPT, SamplingParams(return_routed_experts=True)))
    assert error.value.param == "return_routed_experts"


def test_lora_without_an_adapters_directory_is_refused(default_model_dir):
    engine = LLMEngine(EngineConfig(model_path=str(default_model_dir), kv_cache_memory=8 << 20))
    with pytest.raises(InvalidRequest, match="not enabled"):
        engine.add_request(Request("no-lora", PROMPT, SamplingParams(lora_path="alpha")))


def _tensors_in(value, seen=None) -> list:
    """Every torch.Tensor reachable from a processed request's fields (dataclasses, dicts, tuples, lists)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors_in(getattr(value, f.name), seen)]
    if isinstance(value, dict):
        return [t for item in value.items() for t in _tensors_in(item, seen)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_in(item, seen)]
    return []


def test_request_processing_runs_no_torch_op(engine):
    """Triton's thread processes requests; a torch op there would start a second OpenMP team, which slows every
    step of the core thread. LoRA weights and the allowed_token_ids bitmask stay numpy until the core has them."""
    params = SamplingParams(max_tokens=4, temperature=0.0, lora_path="beta", allowed_token_ids=[5, 17, 300])
    with TorchOps() as recorded:
        request = engine.inputs.process("no-torch", PROMPT, params)
    assert recorded.ops == [] and _tensors_in(request) == []
    assert request.lora.name == "beta" and request.allowed_tokens is not None
    with TorchOps() as recorded:  # the check sees ops: converting the bitmask would be caught
        torch.from_numpy(request.allowed_tokens).to(torch.int64)
    assert recorded.ops
    [result] = generate(engine, [PROMPT], params)  # the core turns them into tensors and honours them
    assert set(result.token_ids()) <= {5, 17, 300}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adapter_weights_read_without_torch_equal_safetensors_own_reading(tmp_path, dtype):
    tensors = {"a": torch.randn(4, 6).to(dtype), "b": torch.randn(3).to(dtype)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    read = read_float32_safetensors(tmp_path / "w.safetensors")
    assert sorted(read) == ["a", "b"]
    for name, tensor in tensors.items():
        assert read[name].dtype == np.float32 and read[name].shape == tuple(tensor.shape)
        assert np.array_equal(read[name], tensor.float().numpy())
