"""Owns the model weights and the paged KV cache; turns a scheduled batch into one forward pass: the inputs
are written into persistent buffers (engine/input_batch.py), the model runs on views of them, and the rows
that matter (sampling positions, prompt chunks asked for) come back as logits and hidden states."""

from __future__ import annotations

import copy
import ctypes
import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.input_batch import InputBuffers, StepInputs
from tritonllm.engine.core.lora_slots import LoraSlotPool
from tritonllm.engine.core.scheduler import ScheduledSequence
from tritonllm.engine.core.sequence import Sequence
from tritonllm.engine.layers.attention import AttentionMetadata
from tritonllm.engine.layers.linear import (BLOCK_FORMATS, Choice, candidates, choose_format, cpu_has_bf16,
                                           fastest_run, onednn_available)
from tritonllm.model_files import cpu_ops_dir
from tritonllm.engine.layers.lora import LayerLora
from tritonllm.engine.models import registry
from tritonllm.engine.models.llama import LlamaForCausalLM
from tritonllm.kernels import cpu as cpu_ops
from tritonllm.kernels.decode_attention import DecodeWorkspace
from tritonllm.kernels import prefill_attention_bf16

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64, arm64 with 4 KiB pages)

@dataclass
class PromptLogits:
    seq: Sequence
    start: int  # prompt position of the first row
    logits: torch.Tensor  # [positions, vocab]: row i predicts the token at start + i + 1


@dataclass
class PromptHiddenStates:
    seq: Sequence
    start: int  # prompt position of the first row
    hidden: torch.Tensor  # [positions, hidden] after the final norm, float32 on the CPU


@dataclass
class StepOutput:
    logits: torch.Tensor  # [samples, vocab] float32: the last-token logits of the sequences that sample
    sample_seqs: list[Sequence]
    prompt_logits: list[PromptLogits]
    # [samples, hidden] float32 on the CPU, the rows the logits came from; None when no sampling sequence asks
    sample_hidden: torch.Tensor | None
    prompt_hidden: list[PromptHiddenStates]
    # [samples, MoE layers, top_k] int64 on the CPU: the experts the sampled rows were routed to; None when no
    # sampling sequence asks (or the model is dense)
    sample_routed_experts: torch.Tensor | None = None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The activation dtype asked for; None on the CPU with auto: the weight format decides."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (choose from auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


def load_model(config: EngineConfig, model_dir: Path, device: torch.device) -> tuple[LlamaForCausalLM, str]:
    """The model with its projections in the configured weight format (on the CPU, auto: the fastest exact or
    near-exact one, measured); returns it with a description of the format."""
    dtype = resolve_dtype(config.dtype, device)
    if config.quantization != "none" and device.type != "cpu":
        raise ValueError(f"quantization {config.quantization} runs on the CPU only (on its block kernels)")
    if config.quantization != "none" and config.weight_format not in ("auto", *BLOCK_FORMATS):
        raise ValueError(f"quantization {config.quantization} makes blocks, which weight_format "
                         f"{config.weight_format} does not run: use auto, int4 or int4-q8")
    if config.quantization != "none" and dtype not in (None, torch.float32):
        raise ValueError(f"quantization {config.quantization} runs on the block kernels, with float32 activations "
                         f"(int8 with int4-q8), not dtype {config.dtype}")
    if device.type != "cpu":
        if config.weight_format not in ("auto", str(dtype).removeprefix("torch.")):
            raise ValueError(f"weight_format {config.weight_format} runs on the CPU only")
        if config.prefill_dtype in ("bfloat16", "int8"):
            raise ValueError(f"prefill_dtype {config.prefill_dtype} is for the CPU engine (on CUDA prompts compute "
                             "in the activations' dtype)")
        if config.decode_dtype == "int8":
            raise ValueError("decode_dtype int8 is for the CPU engine (on CUDA decodes compute in the activations' "
                             "dtype)")
        return registry.from_pretrained(model_dir, dtype, device), f"{dtype} (dense)"
    cpu_ops.load(cpu_ops_dir())  # before the formats are chosen: it offers one
    model, blocks = registry.load_for_cpu(model_dir, config.quantization)
    blocks_alone = any(parameter.is_meta for parameter in model.parameters())  # a GGUF read without a dense copy
    # int8 rows are int4-q8's kernels with one level of codes: auto means that format then
    requested_prefill = "int8" if config.decode_dtype == "int8" and config.prefill_dtype == "auto" \
        else config.prefill_dtype
    weight_format = config.weight_format
    if "int8" in (requested_prefill, config.decode_dtype) and weight_format == "auto":
        weight_format = "int4-q8"
    options = candidates(weight_format, dtype, has_blocks=blocks is not None, blocks_alone=blocks_alone)
    if blocks_alone and not all(option.runs_blocks_alone for option in options):
        model.dequantize_projections(blocks)

    def in_format(model: LlamaForCausalLM, choice: Choice, prefill=torch.float32, decode=torch.float32,
                  last_use=False) -> LlamaForCausalLM:
        model.use_weight_format(choice, blocks, prefill, decode, last_use)
        return model.to(choice.dtype)

    layers = _probe_layers(model)
    if len(options) > 1 and layers < model.arch.num_layers:
        log.info("weight formats timed on the model's first %d layers (a whole copy would not fit in the "
                 "memory available)", layers)
    choice = choose_format(options, lambda option: _decode_step_seconds(in_format(_copy(model, layers), option)))
    prompts_on_blocks = choice.blocks and cpu_ops.has_bf16_ops()  # (Projection's)
    decode = int8_rows("decode_dtype", choice) if config.decode_dtype == "int8" else torch.float32
    prefill = prefill_dtype(requested_prefill, choice, blocks_alone and not prompts_on_blocks)
    if prefill == torch.bfloat16:
        arch = model.arch
        prefill_attention_bf16.warm_up(arch.num_heads, arch.num_kv_heads, arch.head_dim)
    prompts = "" if prefill == torch.float32 else f", {str(prefill).removeprefix('torch.')} prompts"
    decodes = "" if decode == torch.float32 else ", int8 decodes"
    quantized = "" if config.quantization == "none" else f", quantized at load to {config.quantization}"
    return in_format(model, choice, prefill, decode, last_use=True), choice.describe() + prompts + decodes + quantized


def return_freed_memory() -> None:
    """Give the load's freed temporaries (the blocks before packing, a quantizer's arrays) back to the OS: glibc
    keeps the free pages of a heap fragmented by the weights kept between them (hundreds of MB)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def zeroed_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape) on the CPU in an anonymous mapping, whose pages the kernel zeroes as each is first
    written: nothing is written at start (torch.zeros wrote the whole KV cache: seconds a GiB where huge pages fault
    slowly, as in a VM), and a block is resident once used. On transparent huge pages (2 MiB aligned, madvise), as
    torch's allocator puts the weights under launcher.ENGINE_ENV."""
    count = math.prod(shape)
    mapping = mmap.mmap(-1, count * dtype.itemsize + HUGE_PAGE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE
    return torch.frombuffer(mapping, dtype=dtype, count=count, offset=start).view(shape)  # (it keeps the mapping)


def prefill_dtype(requested: str, choice: Choice, needs_copy: bool) -> torch.dtype:
    """What the CPU engine's prompt rows compute in (engine/layers/row_dtype.py). auto takes bf16 where it was
    measured to win (long prompts: AMX 3-4x faster, AVX512-BF16 alone 2.2-2.6x) and keeps every greedy continuation
    of the accuracy set (tests/test_weight_formats.py), but not where it `needs_copy`, a bf16 copy of weights read as
    a GGUF's blocks alone (whose point is no dense copy): the CPU ops run prompts on the blocks themselves. int8: one
    level of int8 codes for the prompt rows of weights whose kernels quantize their inputs (int4-q8)."""
    activations = choice.dtype
    if requested == "int8":
        return int8_rows("prefill_dtype", choice)
    if requested == "auto":
        native = activations == torch.float32 and cpu_has_bf16() and onednn_available() and not needs_copy
        return torch.bfloat16 if native else torch.float32
    if requested == "float32":
        return torch.float32
    if activations != torch.float32:
        raise ValueError(f"prefill_dtype={requested} is for float32 activations; these run in "
                         f"{str(activations).removeprefix('torch.')} already")
    if not (cpu_has_bf16() and onednn_available()):
        raise ValueError(f"prefill_dtype={requested} needs a CPU with bf16 hardware (AMX or AVX512-BF16) and oneDNN; "
                         "without them bf16 is emulated, slower than float32")
    return torch.bfloat16


def int8_rows(setting: str, choice: Choice) -> torch.dtype:
    """int8 rows (prefill_dtype or decode_dtype int8): one level of int8 codes, for weights whose kernels quantize
    their inputs (int4-q8)."""
    if not choice.int8_activations:
        raise ValueError(f"{setting}=int8 is for weights whose kernels quantize their inputs to int8 codes "
                         f"(weight_format int4-q8), not {choice.describe()}")
    return torch.int8


def _probe_layers(model: LlamaForCausalLM) -> int:
    """How many of the model's layers a copy to time the formats on may hold: all of them (the real step) when
    that copy takes under half the memory available, else fewer."""
    available = _memory_available()
    if available is None:
        return model.arch.num_layers
    layer = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    rest = sum(p.numel() * p.element_size() for p in model.parameters()) - layer * len(model.layers)
    return max(1, min(model.arch.num_layers, int((available / 2 - rest) // layer)))


def _memory_available() -> int | None:
    """Bytes of memory available (the kernel's estimate), None where unknown."""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        return int(next(line for line in meminfo if line.startswith("MemAvailable:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def _copy(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A copy of the model with its first `layers` layers."""
    every_layer = model.layers
    model.layers = nn.ModuleList(list(every_layer)[:layers])
    try:
        return copy.deepcopy(model)
    finally:
        model.layers = every_layer


def _decode_step_seconds(model: LlamaForCausalLM) -> float:
    """The fastest decode steps of 1 and 16 tokens (one cached token each) through the model and its LM head."""
    arch, dtype, total, block_size = model.arch, model.embed_tokens.weight.dtype, 0.0, 16
    with torch.inference_mode():
        for tokens in (1, 16):  # a block each
            shape = (tokens, block_size, arch.num_kv_heads, arch.head_dim)
            caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers]
            meta = AttentionMetadata(torch.arange(tokens) * block_size, tokens, torch.arange(tokens)[:, None],
                                     torch.ones(tokens, dtype=torch.int32))
            token_ids, positions = torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long)
            total += fastest_run(lambda: model.compute_logits(model(token_ids, positions, meta, caches)[0]))
    return total


def kv_cache_dtype(requested: str, activations: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the activations' (auto), or float16 for the CPU ops' attention, which reads it with
    float32 activations (the GPU kernels and the bfloat16 path read the activations' dtype only)."""
    if requested == "auto":
        return activations
    if device.type != "cpu" or activations != torch.float32:
        raise ValueError(f"kv_cache_dtype={requested} is for the CPU engine with float32 activations (this engine: "
                         f"{device.type}, {str(activations).removeprefix('torch.')}); leave it auto")
    return torch.float16


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path):
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels launch on the current device: make it this engine's GPU
        self.block_size = config.block_size
        self.model, self.weight_format = load_model(config, model_dir, self.device)
        return_freed_memory()
        self.dtype = self.model.embed_tokens.weight.dtype
        self.prefill_dtype, self.decode_dtype = self.model.prefill_dtype, self.model.decode_dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        arch = self.model.arch
        block_shape = (self.block_size, arch.num_kv_heads, arch.head_dim)
        self.bytes_per_block = (2 * arch.num_layers * self.block_size * arch.num_kv_heads * arch.head_dim
                                * self.kv_dtype.itemsize)
        self.num_blocks = config.kv_cache_memory // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one KV block "
                             f"({self.bytes_per_block} bytes)")

        def zeroed() -> torch.Tensor:
            shape = (self.num_blocks, *block_shape)
            if self.device.type == "cpu":
                return zeroed_on_first_touch(shape, self.kv_dtype)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

        self.kv_caches = [(zeroed(), zeroed()) for _ in range(arch.num_layers)]
        log.info("model on %s, weights %s; KV cache: %d blocks of %d tokens (%.0f MiB, %s)", self.device,
                 self.weight_format, self.num_blocks, self.block_size, self.num_blocks * self.bytes_per_block / 2**20,
                 self.kv_dtype)
        if config.lora_dir and arch.is_moe:
            raise ValueError("LoRA adapters are supported on dense models only; this model has experts "
                             "(leave lora_dir empty)")
        self.lora_slots = (LoraSlotPool(arch, config.max_loras, config.max_lora_rank, self.dtype, self.device)
                           if config.lora_dir else None)
        self.max_model_len = min(config.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        workspace = (DecodeWorkspace.allocate(config.max_num_seqs, arch.num_heads, arch.head_dim, self.device)
                     if self.device.type == "cuda" else None)
        longest = min(self.max_model_len, self.num_blocks * self.block_size)  # no sequence holds more tokens
        self.inputs = InputBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                   -(-longest // self.block_size), self.block_size, self.device, workspace)

    def execute(self, scheduled: list[ScheduledSequence]) -> StepOutput:
        """Run one step: logits (and, when asked for, final hidden states) of the positions that sample, and of
        every position of prompt chunks whose prompt logprobs (hidden states) were asked for."""
        inputs = self.inputs.prepare(scheduled)
        hidden, routed = self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_caches,
                                    self._lora(inputs), inputs.record_routing)
        return self._outputs(inputs, hidden, routed)

    def _lora(self, inputs: StepInputs) -> list[LayerLora] | None:
        """Each layer's adapters for the batch; None skips the LoRA matmuls (a base-only batch)."""
        if not inputs.active_lora_slots:
            return None
        return self.lora_slots.for_layers(inputs.token_lora_slots, inputs.active_lora_slots)

    def _outputs(self, inputs: StepInputs, hidden: torch.Tensor, routed: torch.Tensor | None) -> StepOutput:
        prompt_logits = [PromptLogits(chunk.seq, chunk.start, self.model.compute_logits(hidden[chunk.rows]))
                         for chunk in inputs.prompt_logprob_rows]
        prompt_hidden = [PromptHiddenStates(chunk.seq, chunk.start,
                                            self.model.final_norm(hidden[chunk.rows]).float().cpu())
                         for chunk in inputs.prompt_hidden_rows]
        if not inputs.sample_seqs:
            return StepOutput(torch.empty(0, self.model.arch.vocab_size), [], prompt_logits, None, prompt_hidden)
        normed = self.model.final_norm(hidden.index_select(0, inputs.sample_rows))
        return StepOutput(self.model.logits_of_normed(normed), inputs.sample_seqs, prompt_logits,
                          normed.float().cpu() if inputs.wants_hidden else None, prompt_hidden,
                          None if routed is None else routed.index_select(0, inputs.sample_rows).cpu())
