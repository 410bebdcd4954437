"""prefill_dtype=bfloat16: prompt rows on the CPU's bf16 matrix units. The attention op's paths (the C kernel on AMX
tiles and as AVX512-BF16 dot products, torch's flash kernel) against the float32 reference, a position's result independent of how its prompt is cut into
chunks (to the bit), the engine's output
close to float32 prompts' and independent of what a prompt is batched with; where it may not be asked for and where
auto takes it."""

from __future__ import annotations

import random

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core import model_runner
from tritonllm.engine.core.model_runner import load_model
from tritonllm.engine.layers.linear import Choice, cpu_has_bf16
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.interface.parameters import SamplingParams
from tritonllm.kernels.prefill_attention import prefill_attention_reference
from tritonllm.kernels import cpu
from tritonllm.kernels.prefill_attention_bf16 import prefill_attention_bf16, prefill_attention_flash, warm_up
from tritonllm.model_files import cpu_ops_dir
from engine_helpers import assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch, generate, prefill_logits

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3, 4,"]
needs_bf16_hardware = pytest.mark.skipif(not cpu_has_bf16(), reason="prefill_dtype=bfloat16 needs AMX or "
                                                                    "AVX512-BF16 (refused without: emulated)")


def context(tokens: int, seed: int = 0):
    """A paged KV cache holding `tokens` positions in shuffled blocks, their queries and block table."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-tokens // BLOCK_SIZE) + 3
    k_cache, v_cache = (torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    table = torch.randperm(blocks, generator=generator)[:-3].view(1, -1).int()
    return torch.randn(tokens, HEADS, HEAD_DIM, generator=generator), k_cache, v_cache, table


def in_chunks(op, chunks: list[int], q, k_cache, v_cache, table) -> torch.Tensor:
    """Each chunk's rows attending to the context up to its end, as successive prefill steps would."""
    out, start = [], 0
    for length in chunks:
        end = min(len(q), start + length)
        out.append(op(q[start:end], k_cache, v_cache, torch.tensor([0]), torch.tensor([end - start]),
                      torch.tensor([end]), table, HEAD_DIM ** -0.5))
        start = end
    return torch.cat(out)


def kernel(tiles: bool):
    """The C kernel on AMX tiles, or as dot products."""

    def op(*args) -> torch.Tensor:
        assert cpu.load(cpu_ops_dir())  # the test machines have a C compiler
        if tiles and not cpu.has_amx_tiles():
            pytest.skip("no AMX tiles on this CPU (or OS): the kernel runs as dot products")
        out = cpu.prefill_attention_bf16(*args, tiles=tiles)
        if out is None:
            pytest.skip("no AVX512-BF16 on this CPU: prefill_attention_bf16 takes the flash path")
        return out

    return op


PATHS = [pytest.param(kernel(True), id="amx"), pytest.param(kernel(False), id="avx512-bf16"),
         pytest.param(prefill_attention_flash, id="flash")]


@pytest.mark.parametrize("op", PATHS)
def test_bf16_attention_is_close_to_the_float32_reference(op):
    inputs = context(1300)
    ours = in_chunks(op, [700, 600], *inputs)
    expected = in_chunks(prefill_attention_reference, [1300], *inputs)
    # bf16 queries, keys and probabilities (8-bit mantissas), fp32 sums: outputs here are within about ±3
    assert (ours - expected).abs().max().item() < 0.03


@pytest.mark.parametrize("op", PATHS)
def test_bf16_attention_of_a_position_does_not_depend_on_the_chunks(op):
    """Chunks of 1 to 700 rows, starting anywhere: every position the same bits as the whole prompt in one chunk.
    The flash kernel's sums follow its key splits and its rows' place in a tile of queries: without the fixed
    segments and tile-aligned rows, a chunk of 201 rows gave one position other bits here. The C kernel's block
    maxima must leave out the keys after a query: with them, these cuttings gave other bits."""
    inputs = context(1300)
    warm_up(HEADS, KV_HEADS, HEAD_DIM)  # the flash kernel's first calls in a process may differ, as at engine load
    whole = in_chunks(op, [1300], *inputs)
    cuts = random.Random(0)
    for _ in range(6):
        chunks = [cuts.choice([1, 2, 3, 17, 64, 191, 300, 513, 700]) for _ in range(60)]
        assert torch.equal(in_chunks(op, chunks, *inputs), whole), chunks


@pytest.mark.parametrize("tiles", [True, False], ids=["amx", "avx512-bf16"])
def test_the_c_kernel_reads_a_float16_cache_and_batched_chunks_as_one_at_a_time(tiles):
    """Two prompts' chunks in one call, from a float16 KV cache: each as its own call gives."""
    prefill_attention_c = kernel(tiles)
    q, k_cache, v_cache, table = context(700, seed=1)
    k_cache, v_cache = k_cache.half(), v_cache.half()
    tables = torch.cat([table, table.roll(5, 1)])  # the second prompt: the same blocks in another order
    starts, lens, contexts = torch.tensor([0, 300]), torch.tensor([300, 150]), torch.tensor([500, 650])
    both = prefill_attention_c(q[:450], k_cache, v_cache, starts, lens, contexts, tables, HEAD_DIM ** -0.5)
    for i in range(2):
        alone = prefill_attention_c(q[starts[i]:starts[i] + lens[i]], k_cache, v_cache, torch.tensor([0]),
                                      lens[i:i + 1], contexts[i:i + 1], tables[i:i + 1], HEAD_DIM ** -0.5)
        assert torch.equal(both[starts[i]:starts[i] + lens[i]], alone)
    expected = prefill_attention_reference(q[:450], k_cache, v_cache, starts, lens, contexts, tables,
                                           HEAD_DIM ** -0.5)
    assert (both - expected).abs().max().item() < 0.03


def test_other_head_sizes_take_the_flash_path():
    """The C kernel is written for head size 64; at 128 (Qwen3, Llama-3-8B) it declines and the op runs flash."""
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache = (torch.randn(8, BLOCK_SIZE, 2, 128, generator=generator) for _ in range(2))
    q, table = torch.randn(100, 4, 128, generator=generator), torch.arange(8).view(1, -1)
    args = (q, k_cache, v_cache, torch.tensor([0]), torch.tensor([100]), torch.tensor([100]), table, 128 ** -0.5)
    assert cpu.load(cpu_ops_dir())
    assert cpu.prefill_attention_bf16(*args) is None
    assert torch.equal(prefill_attention_bf16(*args), prefill_attention_flash(*args))
    assert (prefill_attention_bf16(*args) - prefill_attention_reference(*args)).abs().max().item() < 0.03


@pytest.fixture(scope="module")
def float32_model(default_model_dir):
    return load_model(EngineConfig(weight_format="int4", prefill_dtype="float32"), default_model_dir,
                      torch.device("cpu"))[0]


@needs_bf16_hardware
def test_bf16_prompt_logits_stay_close_to_float32(float32_model, default_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model, description = load_model(EngineConfig(weight_format="int4", prefill_dtype="bfloat16"), default_model_dir,
                                    torch.device("cpu"))
    assert description.endswith("bfloat16 prompts")
    agreeing = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours, expected = prefill_logits(model, ids), prefill_logits(float32_model, ids)
        difference = (ours - expected).abs().max().item()
        print(f"{prompt!r}: max |Δlogit| {difference:.2f}")
        assert difference < 1.0  # 0.3 to 0.55 here (logits span about ±27; whole-model bf16 activations: 2.0)
        agreeing += (ours.argmax(-1) == expected.argmax(-1)).tolist()
    assert sum(agreeing) / len(agreeing) >= 0.9


@pytest.fixture(scope="module")
def bf16_engines(default_model_dir):
    """Two engines with bf16 prompts, cutting prompts into different chunks."""
    def engine(budget: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="int4",
                                      prefill_dtype="bfloat16", max_num_batched_tokens=budget,
                                      kv_cache_memory=64 << 20))
    return engine(512), engine(300)


@needs_bf16_hardware
def test_a_bf16_prompts_output_does_not_depend_on_its_chunks_or_its_batch(bf16_engines):
    assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch(*bf16_engines, PROMPTS)


@needs_bf16_hardware
def test_bf16_prompts_keep_most_greedy_continuations(bf16_engines, default_model_dir):
    float32 = LLMEngine(EngineConfig(model_path=str(default_model_dir), weight_format="int4",
                                     prefill_dtype="float32", kv_cache_memory=32 << 20))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    expected = [r.token_ids() for r in generate(float32, PROMPTS, greedy)]
    ours = [r.token_ids() for r in generate(bf16_engines[0], PROMPTS, greedy)]
    same = sum(a == b for a, b in zip(ours, expected))
    print(f"bf16 prompts: {same}/{len(PROMPTS)} greedy continuations identical")
    assert same == len(PROMPTS)  # auto picks bf16 prompts on bf16 hardware: they must keep every one


def test_bf16_prompts_are_refused_with_bf16_activations_and_without_bf16_hardware(default_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="for float32 activations"):
        load_model(EngineConfig(weight_format="bfloat16", dtype="bfloat16", prefill_dtype="bfloat16"),
                   default_model_dir, torch.device("cpu"))
    monkeypatch.setattr(model_runner, "cpu_has_bf16", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with bf16 hardware"):
        load_model(EngineConfig(weight_format="int4", prefill_dtype="bfloat16"), default_model_dir,
                   torch.device("cpu"))


@pytest.mark.parametrize("bf16_hardware, needs_copy, activations, expected", [
    (True, False, torch.float32, torch.bfloat16),  # AMX, or AVX512-BF16 alone (Zen 4/5): both measured to win
    (False, False, torch.float32, torch.float32),  # AVX2: bf16 would be emulated
    (True, True, torch.float32, torch.float32),  # a GGUF read as its blocks: no dense copy of the weights
    (True, False, torch.bfloat16, torch.float32),  # the activations are bf16 already
])
def test_auto_takes_bf16_prompts_on_cpus_with_bf16_hardware_only(bf16_hardware, needs_copy, activations, expected,
                                                                   monkeypatch):
    monkeypatch.setattr(model_runner, "cpu_has_bf16", lambda: bf16_hardware)
    assert model_runner.prefill_dtype("auto", Choice("int4", activations, "cpu_ops"), needs_copy) == expected
