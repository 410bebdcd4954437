"""GGUF files run on their own blocks: Q4_0 and Q4_1 repacked exactly onto the int4 kernels, Q5_1 and Q5_K
onto the int5 one, Q8_0, Q5_0, Q4_K and Q6_K as stored on kernels of their own (for int8 activations each in row
groups of the integer kernels), for llama and qwen3 files; what the kernels compute
is `gguf.quants.dequantize`'s weights to the bit; a type without a kernel runs dequantized, said once in the log;
the engine's logits are the dense model's. A file is read as it is, without a dense copy on disk or in memory,
to the same logits as its dense conversion with the blocks beside it."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Type
from gguf import quants

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.model_runner import load_model
from tritonllm.engine.layers import linear
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.models import registry
from tritonllm.engine.models import weights as weights_module
from tritonllm import gguf_blocks
from tritonllm.gguf_blocks import COVERED_TYPES, Int4Blocks, Int5Blocks, Q5Blocks, Q8Blocks, SuperBlocks, kernel_blocks
from tritonllm.interface.parameters import SamplingParams
from tritonllm.kernels import cpu as cpu_ops
from tritonllm.kernels.cpu import super_blocks
from tritonllm.model_files import GGUF_LINK, convert_gguf, cpu_ops_dir
from engine_helpers import generate, prefill_logits
from gguf_models import MIXED_TYPES, random_blocks, write_tiny_gguf

ROWS, WIDTH = 24, 512
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def _identity_outputs(projection, width: int) -> torch.Tensor:
    """The weights a projection computes with, read back through it: row t of I @ W.T is W[:, t], each output
    a single product w · 1 (the rest add zeros), so exactly the weight the kernel used."""
    return projection(torch.eye(width)).T


# int4-q8: each type's integer kernel, in row groups (Q5_0, Q5_1, Q5_K as int5 blocks)
INTEGER_PROJECTIONS = {Type.Q4_0: "Q4Projection", Type.Q4_1: "Q4Projection", Type.Q4_K: "SuperBlockRowsProjection",
                       Type.Q5_0: "Int5Projection", Type.Q5_1: "Int5Projection", Type.Q5_K: "Int5Projection",
                       Type.Q8_0: "Q8Projection", Type.Q6_K: "SuperBlockRowsProjection"}


@pytest.mark.parametrize("qtype", COVERED_TYPES, ids=lambda t: t.name)
def test_the_kernels_compute_with_ggufs_own_dequantized_weights(qtype):
    raw = random_blocks(qtype, ROWS, WIDTH, np.random.default_rng(1))
    reference = torch.from_numpy(quants.dequantize(raw, qtype).reshape(ROWS, WIDTH))
    blocks = kernel_blocks(raw, qtype, ROWS)
    assert blocks is not None
    assert cpu_ops.load(cpu_ops_dir())
    if isinstance(blocks, Int4Blocks):
        weight, kind = linear.Q4Weight(*(torch.from_numpy(t) for t in (blocks.q, blocks.d, blocks.m))), "Q4"
    elif isinstance(blocks, Int5Blocks):
        weight, kind = linear.Int5Weight(*(torch.from_numpy(t) for t in (blocks.q, blocks.d, blocks.m))), "Int5"
    elif isinstance(blocks, Q8Blocks):
        weight, kind = linear.Q8Weight(torch.from_numpy(blocks.blocks)), "Q8"
    elif isinstance(blocks, Q5Blocks):
        weight, kind = linear.Q5Weight(torch.from_numpy(blocks.blocks)), "Q5"
    else:
        assert isinstance(blocks, SuperBlocks) and blocks.kind == qtype.name.lower()
        weight, kind = linear.SuperBlockWeight(blocks.kind, torch.from_numpy(blocks.blocks)), "SuperBlock"
    projection = linear.Choice("int4", torch.float32, "cpu_ops").make(reference, None, weight)
    assert type(projection).__name__ == f"{kind}Projection"
    assert torch.equal(_identity_outputs(projection, WIDTH), reference)  # to the bit (±0 aside)
    x = torch.randn(5, WIDTH)
    torch.testing.assert_close(projection(x), x @ reference.T, atol=1e-4, rtol=1e-4)
    for row in range(len(x)):  # each token alone gives the same row, to the bit
        assert torch.equal(projection(x[row:row + 1])[0], projection(x)[row])
    if isinstance(blocks, Q5Blocks):  # the Q8_0 kernel over the same numbers (what ran before): the same bits
        as_q8 = linear.Choice("int4", torch.float32, "cpu_ops").make(reference, None, weight.as_q8())
        assert type(as_q8).__name__ == "Q8Projection" and torch.equal(as_q8(x), projection(x))
    if qtype == Type.Q4_K:  # for torch's int4 kernel, int4 blocks of the same numbers
        assert torch.equal(weight.as_q4().dequantize(), reference)
    if qtype in (Type.Q5_0, Type.Q5_K):  # for the integer kernels, int5 blocks of the same numbers
        assert torch.equal(weight.as_int5().dequantize(), reference)
    integer = linear.Choice("int4-q8", torch.float32, "cpu_ops").make(reference, None, weight)
    assert type(integer).__name__ == INTEGER_PROJECTIONS[qtype]
    if qtype != Type.Q5_K:  # the row groups' scales exact (Q5_K's d·sc in fp16 may not be): within the inputs' steps
        step = x.reshape(len(x), -1, 32).abs().amax(-1).repeat_interleave(32, 1) / (127 * 256)
        assert ((integer(x) - x @ reference.T).abs() <= step @ reference.abs().T + 1e-5).all()


def test_q4_k_blocks_are_scale_and_min():
    """Q4_K's (d·sc)·q − dmin·mn as int4's d'·q + m', with d' and m' rounded once to fp32 as gguf rounds them."""
    raw = random_blocks(Type.Q4_K, 2, 256, np.random.default_rng(2)).reshape(2, 1, 144)
    _, d, m = super_blocks.q4_k_scale_min(torch.from_numpy(raw))
    scale, scale_min = (raw[..., offset:offset + 2].copy().view(np.float16).astype(np.float32).reshape(2, 1)
                        for offset in (0, 2))
    sc, mn = quants.Q4_K.get_scale_min(raw.reshape(2, 144)[:, 4:16])
    assert np.array_equal(d.numpy(), scale * sc.astype(np.float32))
    assert np.array_equal(m.numpy(), -(scale_min * mn.astype(np.float32)))


def test_a_type_without_kernel_or_inexact_blocks_is_refused():
    rng = np.random.default_rng(3)
    assert kernel_blocks(random_blocks(Type.Q3_K, ROWS, WIDTH, rng), Type.Q3_K, ROWS) is None
    raw = random_blocks(Type.Q4_0, ROWS, WIDTH, rng)
    raw.reshape(ROWS, -1, 18)[0, 0, :2] = np.array([np.inf], np.float16).view(np.uint8)  # d · q − 8d: inf − inf
    assert kernel_blocks(raw, Type.Q4_0, ROWS) is None


def test_the_check_compares_rows_first_to_last_in_their_reordered_places(monkeypatch):
    """The load compares CHECKED_ROWS rows spread from a tensor's first to its last (gguf's numpy dequantization of
    every row was most of a load), each against its own row of the file where rows are reordered (llama's q/k): a
    bad block in a compared row (our row 17, the file's row 6) refuses the blocks."""
    monkeypatch.setattr(gguf_blocks, "CHECKED_ROWS", 5)
    assert gguf_blocks.checked_rows(ROWS).tolist() == [0, 6, 12, 17, 23]
    assert gguf_blocks.checked_rows(3).tolist() == [0, 1, 2]
    rng = np.random.default_rng(4)
    raw = random_blocks(Type.Q4_K, ROWS, WIDTH, rng)
    reverse = lambda x: x[::-1]  # noqa: E731
    blocks = kernel_blocks(raw, Type.Q4_K, ROWS, reverse)
    assert np.array_equal(blocks.dequantize(), quants.dequantize(raw, Type.Q4_K).reshape(ROWS, WIDTH)[::-1])
    raw.reshape(ROWS, -1, 144)[6, 1, :2] = np.array([np.inf], np.float16).view(np.uint8)
    assert kernel_blocks(raw, Type.Q4_K, ROWS, reverse) is None


@pytest.mark.parametrize("qtype", [Type.Q8_0, Type.Q5_0, Type.Q4_K, Type.Q5_K, Type.Q6_K], ids=lambda t: t.name)
def test_the_load_checks_blocks_kept_as_the_file_stores_them_as_the_kernels_read_them(qtype, monkeypatch):
    """A file's blocks that the kernels read as they are (Q8_0, Q5_0, the K-quants) are checked against gguf's
    numbers through the CPU ops' own dequantization: a reading that differs anywhere refuses them."""
    assert cpu_ops.load(cpu_ops_dir())
    raw = random_blocks(qtype, ROWS, WIDTH, np.random.default_rng(5))
    blocks = kernel_blocks(raw, qtype, ROWS)
    assert blocks is not None
    ours = cpu_ops.dequantize_blocks(blocks.kind, torch.from_numpy(blocks.blocks))
    assert np.array_equal(ours.numpy(), quants.dequantize(raw, qtype).reshape(ROWS, WIDTH))
    ours[ROWS - 1, WIDTH - 1] += 1.0  # one weight read otherwise, in the last row
    monkeypatch.setattr(cpu_ops, "dequantize_blocks", lambda kind, blocks: ours)
    assert kernel_blocks(raw, qtype, ROWS) is None


# llama: every type covered (Q6_K down in layer 1, an untied Q6_K head): it decodes in one call of the CPU ops;
# qwen3: Q3_K, which has no kernel, in a down projection and beside Q6_K in a gate_up (and q/k norms: it decodes op
# by op), its tied Q8_0 embedding
TYPES = {"llama": {**MIXED_TYPES, (1, "ffn_down"): Type.Q6_K}, "qwen3": {**MIXED_TYPES, (1, "ffn_up"): Type.Q3_K}}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def gguf_model_dir(request, tmp_path_factory) -> Path:
    """A tiny GGUF prepared as a user's file is: its config and tokenizer, and a link to it. Beside it, in
    ../converted, the same file's dense conversion (transformers' dequantization, the blocks kept beside it)."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = write_tiny_gguf(root / f"tiny-{arch}.gguf", arch, TYPES[arch], head=Type.Q6_K if arch == "llama" else None)
    convert_gguf(path, root / "converted", dense=True)
    return convert_gguf(path, root / "linked")


@pytest.fixture(scope="module")
def converted_model_dir(gguf_model_dir) -> Path:
    return gguf_model_dir.parent / "converted"


@pytest.fixture(scope="module")
def dense_model(converted_model_dir):
    """The dense conversion as loaded: transformers' dequantization of the file, plain fp32 modules."""
    return registry.from_pretrained(converted_model_dir, torch.float32, torch.device("cpu"))


def test_a_gguf_is_prepared_without_a_dense_copy(gguf_model_dir):
    """The prepared directory is config, tokenizer and a link: no weights written (a dense conversion of this tiny
    file is 50 MB of float32)."""
    assert (gguf_model_dir / GGUF_LINK).resolve() == next(gguf_model_dir.parent.glob("*.gguf")).resolve()
    assert not list(gguf_model_dir.rglob("*.safetensors"))
    written = sum(p.stat().st_size for p in gguf_model_dir.rglob("*") if p.is_file() and not p.is_symlink())
    assert written < 8 << 20  # the tokenizer's files


def test_a_gguf_loads_as_its_blocks_alone(gguf_model_dir):
    """Every projection, head and embedding the kernels run from blocks has no dense weight in memory (a meta
    tensor): what is dense is the norms and what has a type without a kernel (qwen3's Q3_K down and gate_up)."""
    model, blocks = registry.load_for_cpu(gguf_model_dir)
    arch, dense = model.arch, []
    for i in range(arch.num_layers):
        for (owner, name), block in zip(model._projections(i), blocks.layers[i]):
            if not getattr(owner, name).weight.is_meta:
                dense.append((i, name))
                assert block is None or isinstance(block, linear.MixedWeight) and None in block.parts
    assert dense == ([] if not arch.qk_norm else [(1, "gate_up_proj"), (1, "down_proj")])  # qwen3's Q3_K
    assert model.lm_head is None or model.lm_head.weight.is_meta  # llama's untied Q6_K head
    projections = {id(getattr(owner, name).weight) for i in range(arch.num_layers)
                   for owner, name in model._projections(i)}
    assert model.embed_tokens.weight.is_meta  # its blocks (Q8_0)
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in projections and not p.is_meta)
    assert rest < 64 << 10  # the norms


def test_the_embedding_is_looked_up_in_its_blocks(gguf_model_dir, dense_model):
    """Served from its blocks, the embedding's rows are the file's dequantized rows, to the bit, with no dense copy."""
    model, _ = load_model(EngineConfig(weight_format="int4"), gguf_model_dir, torch.device("cpu"))
    assert model.embed_tokens.weight.is_meta and not any(p.is_meta for p in model.parameters())
    ids = torch.tensor([0, 5, 49151, 5, 1234])
    assert torch.equal(model.embed_tokens(ids), dense_model.embed_tokens(ids))


AUTO_ON_BLOCKS = "int4-q8 (cpu_ops kernel, two-level int8 per block of 32 activations)"


@pytest.mark.parametrize("weight_format, runs_as", [("auto", "int4-q8"), ("int4", "int4"), ("int4-q8", "int4-q8")])
def test_a_gguf_read_as_it_is_gives_its_dense_conversions_logits(gguf_model_dir, converted_model_dir,
                                                                 weight_format, runs_as):
    """The file read tensor by tensor, its blocks alone, against today's conversion (transformers' dequantization
    into safetensors, the blocks beside it): the same logits, to the bit. auto runs the blocks through the CPU ops'
    int4-q8, untimed (timing another format would need the dense copy)."""
    ids = list(range(100, 140))
    linked, description = load_model(EngineConfig(weight_format=weight_format, prefill_dtype="float32"),
                                     gguf_model_dir, torch.device("cpu"))
    converted, expected = load_model(EngineConfig(weight_format=runs_as, prefill_dtype="float32"),
                                     converted_model_dir, torch.device("cpu"))
    assert description == expected and description.startswith(f"{runs_as} (cpu_ops kernel")
    assert torch.equal(prefill_logits(linked, ids), prefill_logits(converted, ids))


def test_a_gguf_read_as_it_is_runs_bf16_prompts_on_its_blocks_without_a_copy(gguf_model_dir, converted_model_dir):
    """auto's bf16 prompts need no dense copy where the CPU has bf16 hardware (AMX, AVX512-BF16): a projection's
    prompt rows run on its blocks (block_matmul_bf16), and only a projection of a type the kernels do not cover (the
    tiny file's Q3_K, dequantized anyway) holds bf16 weights for them. The conversion runs the same blocks: the same
    logits. Without it auto keeps float32 prompts (a copy would defeat reading the blocks alone)."""
    ids = list(range(100, 140))
    linked, description = load_model(EngineConfig(), gguf_model_dir, torch.device("cpu"))
    if not (cpu_ops.has_bf16_ops() and linear.cpu_has_bf16()):
        assert description == AUTO_ON_BLOCKS
        return
    assert description == f"{AUTO_ON_BLOCKS}, bfloat16 prompts"
    projections = [getattr(owner, name) for i in range(linked.arch.num_layers) for owner, name in linked._projections(i)]
    on_blocks = [p for p in projections if p.plain_block_parts() is not None]
    assert on_blocks and all(p.prompt_parts is not None and p.prompt_weight is None for p in on_blocks)
    assert all(p.prompt_weight is not None for p in projections if p.plain_block_parts() is None)
    converted, _ = load_model(EngineConfig(weight_format="int4-q8", prefill_dtype="bfloat16"), converted_model_dir,
                              torch.device("cpu"))
    assert torch.equal(prefill_logits(linked, ids), prefill_logits(converted, ids))


def test_a_dense_format_gets_the_files_numbers(gguf_model_dir, dense_model):
    """For a format that multiplies dense weights (float32 here), the blocks read from the file are dequantized at
    load: transformers' dequantization of the file, to the bit."""
    model, blocks = registry.load_for_cpu(gguf_model_dir)
    model.dequantize_projections(blocks)
    assert torch.equal(model.head_weight(), dense_model.head_weight())
    for i in range(model.arch.num_layers):
        for ours, expected in zip(model.projection_weights(i), dense_model.projection_weights(i)):
            assert torch.equal(ours, expected)
    assert torch.equal(model.embed_tokens.weight, dense_model.embed_tokens.weight)


def test_auto_may_pick_the_blocks_and_keeps_greedy_output(gguf_model_dir):
    assert {"int4", "int4-q8"} <= {c.weight_format for c in linear.candidates("auto", None, has_blocks=True)}
    assert linear.candidates("auto", None, has_blocks=True, blocks_alone=True) == [
        linear.Choice("int4-q8", torch.float32, "cpu_ops")]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = {}
    for weight_format in ("float32", "auto"):
        engine = LLMEngine(EngineConfig(model_path=str(gguf_model_dir), weight_format=weight_format,
                                        kv_cache_memory=16 << 20))
        outputs[weight_format] = [r.token_ids() for r in generate(engine, PROMPTS, greedy)]
    assert outputs["auto"] == outputs["float32"]


@pytest.mark.parametrize("gguf_model_dir", ["llama"], indirect=True)  # qwen3's q/k norms: op by op
@pytest.mark.parametrize("weight_format", ["int4", "int4-q8"])
def test_a_decode_step_in_one_call_runs_every_kind_of_part(gguf_model_dir, weight_format):
    """llama_forward over every kind of part (a qkv of three kinds): the same hidden states as op by op, to
    the bit, for a batch of sequences at different lengths."""
    engines = [LLMEngine(EngineConfig(model_path=str(gguf_model_dir), weight_format=weight_format,
                                      kv_cache_memory=16 << 20)) for _ in range(2)]
    assert engines[0].core.runner.model.layers_in_one_call
    engines[1].core.runner.model.layers_in_one_call = False
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True, return_hidden_states=True)
    fused, op_by_op = (generate(engine, PROMPTS + ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"], params)
                       for engine in engines)
    for one, other in zip(fused, op_by_op):
        assert one.token_ids() == other.token_ids()
        states = [[h for o in result.outputs for c in o.choices for h in c.hidden_states] for result in (one, other)]
        assert len(states[0]) == 5 and all(torch.equal(a, b) for a, b in zip(*states))
