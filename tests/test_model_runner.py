"""The model runner's step inputs: persistent buffers filled on the host, a decode forward that reads nothing
back from the device and allocates nothing for its inputs (what CUDA graphs need), shown on the CPU."""

from __future__ import annotations

import gc

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.model_runner import HUGE_PAGE, kv_cache_dtype, zeroed_on_first_touch
from tritonllm.engine.core.scheduler import ScheduledSequence
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.layers.attention import AttentionMetadata
from tritonllm.engine.llm_engine import LLMEngine, Request
from engine_helpers import EXACT, TorchOps, generate

# ops that read a tensor's values back to the host (a device sync) or give data-dependent shapes
DATA_DEPENDENT = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten._unique2.default",
                  "aten.unique_dim.default", "aten.masked_select.default", "aten.unique_consecutive.default"}
VIEWS = {"aten.slice.Tensor", "aten.select.int", "aten.alias.default"}


@pytest.fixture(scope="module")
def decoding(default_model_dir):
    """An engine whose three sequences (prompts of 5, 23 and 40 tokens: 1 to 3 KV blocks) all decode."""
    engine = LLMEngine(EngineConfig(model_path=str(default_model_dir), **EXACT, kv_cache_memory=32 << 20))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, length in enumerate((5, 23, 40)):
        engine.add_request(Request(f"d{i}", list(range(100 + i, 100 + i + length)), params))
    for _ in range(3):
        engine.step()
    running = engine.core.scheduler.running
    assert len(running) == 3 and all(seq.num_output_tokens > 0 for seq in running)
    return engine, [ScheduledSequence(seq, 1) for seq in running]


def _fresh_decode_logits(runner, scheduled: list[ScheduledSequence]) -> torch.Tensor:
    """The same decode step with every input made anew from Python lists, as the runner did before buffers."""
    size = runner.block_size
    seqs = [item.seq for item in scheduled]
    positions = [seq.num_computed_tokens for seq in seqs]
    width = max(-(-(p + 1) // size) for p in positions)
    tables = [seq.block_table[:width] + [0] * (width - len(seq.block_table[:width])) for seq in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([seq.block_table[p // size] * size + p % size for seq, p in zip(seqs, positions)]),
        num_decode_tokens=len(seqs), decode_block_tables=torch.tensor(tables),
        decode_context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32))
    hidden, _ = runner.model(torch.tensor([seq.token_ids[p] for seq, p in zip(seqs, positions)]),
                             torch.tensor(positions), meta, runner.kv_caches)
    return runner.model.compute_logits(hidden)


def test_decode_from_persistent_buffers_twice_equals_a_fresh_call(decoding):
    engine, scheduled = decoding
    runner = engine.core.runner
    first = runner.execute(scheduled)
    buffers = runner.inputs.prepare(scheduled)
    second = runner.execute(scheduled)  # rewrites the same K/V into the same slots
    again = runner.inputs.prepare(scheduled)
    assert first.sample_seqs == second.sample_seqs == [item.seq for item in scheduled]
    assert torch.equal(first.logits, second.logits)
    torch.testing.assert_close(first.logits, _fresh_decode_logits(runner, scheduled), atol=1e-5, rtol=1e-5)
    # the same memory every step: what a captured graph reads
    for name in ("input_ids", "positions", "sample_rows"):
        assert getattr(buffers, name).data_ptr() == getattr(again, name).data_ptr()
    assert buffers.attention.slot_mapping.data_ptr() == again.attention.slot_mapping.data_ptr()
    assert buffers.attention.decode_block_tables.data_ptr() == again.attention.decode_block_tables.data_ptr()


def test_decode_step_makes_no_input_tensor_and_its_forward_reads_nothing_back(decoding):
    engine, scheduled = decoding
    runner = engine.core.runner
    with TorchOps() as preparing:
        inputs = runner.inputs.prepare(scheduled)
    assert set(preparing.ops) <= VIEWS, sorted(set(preparing.ops) - VIEWS)  # views of the buffers, nothing made
    with TorchOps() as forward:
        runner.model(inputs.input_ids, inputs.positions, inputs.attention, runner.kv_caches)
    assert forward.ops and not set(forward.ops) & DATA_DEPENDENT, sorted(set(forward.ops) & DATA_DEPENDENT)
    with TorchOps() as syncing:  # the check sees a host read where there is one
        inputs.attention.decode_context_lens.max().item()
    assert set(syncing.ops) & DATA_DEPENDENT


def test_mixed_step_of_decodes_and_prefill_chunks_keeps_greedy_outputs(default_model_dir):
    """Chunked prefill beside decodes, prompt logprobs across chunks, from the same buffers step after step."""
    config = dict(model_path=str(default_model_dir), **EXACT, kv_cache_memory=32 << 20)
    batched = LLMEngine(EngineConfig(**config, max_num_batched_tokens=24))
    alone = LLMEngine(EngineConfig(**config))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompts = [list(range(200, 200 + n)) for n in (7, 30, 61)]
    results = {}
    for engine, tag in ((batched, "batched"), (alone, "alone")):
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"{tag}{i}", prompt, params))
            if tag == "alone":  # one at a time
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        results.setdefault(output.request_id, []).append(output)
        while engine.has_unfinished_requests():
            for output in engine.step():
                results.setdefault(output.request_id, []).append(output)

    def tokens(request_id):
        return [t for o in results[request_id] for c in o.choices for t in c.token_ids]

    def prompt_logprobs(request_id):
        return next(o.prompt_logprobs for o in results[request_id] if o.prompt_logprobs is not None)

    for i in range(len(prompts)):
        assert tokens(f"batched{i}") == tokens(f"alone{i}") and len(tokens(f"alone{i}")) == 12
        ours, reference = prompt_logprobs(f"batched{i}"), prompt_logprobs(f"alone{i}")
        assert len(ours) == len(reference) == len(prompts[i])
        for a, b in zip(ours[1:], reference[1:]):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_the_formats_are_timed_on_a_copy_that_fits_in_half_the_memory_available(default_model_dir, monkeypatch):
    """The whole model where twice its bytes fit (the real step), else its first layers only; never fewer than one;
    the copy is the model's own numbers and leaves the model whole."""
    from tritonllm.engine.core import model_runner
    from tritonllm.engine.models import registry

    model = registry.from_pretrained(default_model_dir, torch.float32, torch.device("cpu"))
    layer = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    for available, layers in [(None, 30), (4 * whole, 30), (2 * (whole - 20 * layer), 10), (1000, 1)]:
        monkeypatch.setattr(model_runner, "_memory_available", lambda: available)
        assert model_runner._probe_layers(model) == layers, available
    copy = model_runner._copy(model, 10)
    assert len(copy.layers) == 10 and len(model.layers) == 30
    assert torch.equal(copy.layers[9].mlp.down_proj.weight, model.layers[9].mlp.down_proj.weight)
    assert copy.layers[9].mlp.down_proj.weight.data_ptr() != model.layers[9].mlp.down_proj.weight.data_ptr()


def test_a_float16_kv_cache_holds_twice_the_blocks_and_moves_logprobs_by_its_rounding_only(default_model_dir):
    """kv_cache_dtype float16 (the CPU ops read it, prefill and decode): the same memory holds twice the blocks, the
    prompt logprobs move by the keys' and values' rounding (~1e-3, not 0: the cache really is float16), and the
    greedy tokens stay those of the float32 cache."""
    config = dict(model_path=str(default_model_dir), weight_format="int4", dtype="float32", prefill_dtype="float32",
                  kv_cache_memory=32 << 20)
    engines = {dtype: LLMEngine(EngineConfig(**config, kv_cache_dtype=dtype)) for dtype in ("auto", "float16")}
    runners = {dtype: engine.core.runner for dtype, engine in engines.items()}
    assert runners["auto"].kv_caches[0][0].dtype == torch.float32
    assert runners["float16"].kv_caches[0][0].dtype == torch.float16
    assert 2 * runners["float16"].bytes_per_block == runners["auto"].bytes_per_block
    assert runners["float16"].num_blocks >= 2 * runners["auto"].num_blocks
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    results = {dtype: generate(engine, prompts, params) for dtype, engine in engines.items()}
    for exact, half in zip(results["auto"], results["float16"]):
        assert half.token_ids() == exact.token_ids() and len(exact.token_ids()) == 32
        moved = [abs(a.logprob - b.logprob) for a, b in zip(*(
            next(o.prompt_logprobs for o in r.outputs if o.prompt_logprobs is not None)[1:] for r in (exact, half)))]
        assert 0 < max(moved) < 2e-2


def test_a_float16_kv_cache_is_for_the_cpu_ops_float32_activations():
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert kv_cache_dtype("float16", torch.float32, torch.device("cpu")) == torch.float16
    for activations, device in ((torch.bfloat16, "cpu"), (torch.float32, "cuda"), (torch.bfloat16, "cuda")):
        with pytest.raises(ValueError, match="kv_cache_dtype=float16 is for the CPU engine"):
            kv_cache_dtype("float16", activations, torch.device(device))


def _resident_anonymous_bytes() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(status["RssAnon"].split()[0]) * 1024


def test_the_kv_cache_costs_nothing_until_a_block_is_written(decoding):
    """The CPU KV cache is zeros that no start-up pass wrote: not resident until used (torch.zeros made every page
    resident at once: seconds a GiB where huge pages fault slowly), on 2 MiB boundaries for huge pages."""
    engine, _ = decoding
    key_cache, value_cache = engine.core.runner.kv_caches[0]
    assert key_cache.data_ptr() % HUGE_PAGE == 0 and value_cache.data_ptr() % HUGE_PAGE == 0
    before = _resident_anonymous_bytes()
    cache = zeroed_on_first_touch((64, 16, 2, 2048), torch.float32)  # 512 MiB
    assert _resident_anonymous_bytes() - before < 16 << 20
    cache[3, 5] = 1.5
    del cache  # nothing else kept: the view must keep its mapping
    gc.collect()
    again = zeroed_on_first_touch((64, 16, 2, 2048), torch.float32)
    assert not again.any() and again.is_contiguous()  # zeros, every byte (read through the zero page)
    again[63, 15] = 2.0
    assert again.sum() == 2.0 * 2 * 2048
