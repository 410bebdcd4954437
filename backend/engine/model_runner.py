"""Owns the model weights and the paged KV cache; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.layers.attention import AttentionMetadata, PrefillChunk
from backend.engine.lora_slots import LoraSlotPool
from backend.engine.scheduler import ScheduledSequence
from backend.engine.sequence import Sequence
from backend.layers.linear import candidates, choose_format
from backend.models import registry
from backend.models.llama import LlamaForCausalLM
from backend.models.weights import read_q4_1_blocks

log = logging.getLogger(__name__)

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
    if device.type != "cpu":
        if config.weight_format not in ("auto", str(dtype).removeprefix("torch.")):
            raise ValueError(f"weight_format {config.weight_format} runs on the CPU only")
        return registry.from_pretrained(model_dir, dtype, device), f"{dtype} (dense)"
    model = registry.from_pretrained(model_dir, torch.float32, device)
    q4 = read_q4_1_blocks(model_dir, model.arch)
    options = candidates(config.weight_format, dtype, has_q4=q4 is not None)
    choice = choose_format(options, model.projection_weights(0), None if q4 is None else q4[0],
                           model.head_weight())
    model.use_weight_format(choice, q4)
    return model.to(choice.dtype), choice.describe()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path):
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels launch on the current device: make it this engine's GPU
        self.block_size = config.block_size
        self.model, self.weight_format = load_model(config, model_dir, self.device)
        self.dtype = self.model.embed_tokens.weight.dtype
        arch = self.model.arch
        block_shape = (self.block_size, arch.num_kv_heads, arch.head_dim)
        self.bytes_per_block = (2 * arch.num_layers * self.block_size * arch.num_kv_heads * arch.head_dim
                                * self.dtype.itemsize)
        self.num_blocks = config.kv_cache_memory // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes is less than one KV block "
                             f"({self.bytes_per_block} bytes)")
        self.kv_caches = [
            (torch.zeros(self.num_blocks, *block_shape, dtype=self.dtype, device=self.device),
             torch.zeros(self.num_blocks, *block_shape, dtype=self.dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]
        log.info("model on %s, weights %s; KV cache: %d blocks of %d tokens (%.0f MiB)", self.device,
                 self.weight_format, self.num_blocks, self.block_size, self.num_blocks * self.bytes_per_block / 2**20)
        if config.lora_dir and arch.is_moe:
            raise ValueError("LoRA adapters are supported on dense models only; this model has experts "
                             "(leave lora_dir empty)")
        self.lora_slots = (LoraSlotPool(arch, config.max_loras, config.max_lora_rank, self.dtype, self.device)
                           if config.lora_dir else None)

    def _block_tables(self, block_tables: list[list[int]], context_len: int) -> torch.Tensor:
        """[sequences, blocks covering context_len], padded with block 0 (masked out by the caller)."""
        width = -(-context_len // self.block_size)
        rows = [table[:width] + [0] * (width - len(table[:width])) for table in block_tables]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def execute(self, scheduled: list[ScheduledSequence]) -> StepOutput:
        """Run one step: logits (and, when asked for, final hidden states) of the positions that sample, and of
        every position of prompt chunks whose prompt logprobs (hidden states) were asked for."""
        # one-token queries first (batched attention), then prefill chunks (attention per chunk)
        ordered = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        lora_slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_chunks: list[tuple[Sequence, int, int, int]] = []  # (sequence, first row, first position, rows)
        hidden_chunks: list[tuple[Sequence, int, int, int]] = []  # the same, for prompt hidden states
        for item in ordered:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            scored = min(end, seq.num_prompt_tokens - 1) - start  # positions that predict a prompt token
            if seq.needs_prompt_logprobs and scored > 0:
                prompt_chunks.append((seq, len(input_ids), start, scored))
            in_prompt = min(end, seq.num_prompt_tokens) - start  # prompt positions of this chunk
            if seq.needs_prompt_hidden_states and in_prompt > 0:
                hidden_chunks.append((seq, len(input_ids), start, in_prompt))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            lora_slots.extend([seq.lora_slot] * item.num_new_tokens)
            table, size = seq.block_table, self.block_size
            slot_mapping.extend(table[p // size] * size + p % size for p in range(start, end))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        decodes = [s for s in ordered if s.num_new_tokens == 1]
        decode_tables = decode_context_lens = None
        if decodes:
            context_lens = [s.seq.num_computed_tokens + 1 for s in decodes]
            decode_tables = self._block_tables([s.seq.block_table for s in decodes], max(context_lens))
            decode_context_lens = torch.tensor(context_lens, dtype=torch.int32, device=self.device)
        prefills = []
        row = len(decodes)
        for item in ordered[len(decodes):]:
            context_len = item.seq.num_computed_tokens + item.num_new_tokens
            table = self._block_tables([item.seq.block_table], context_len)[0]
            prefills.append(PrefillChunk(row, item.num_new_tokens, context_len, table))
            row += item.num_new_tokens

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes), decode_block_tables=decode_tables,
            decode_context_lens=decode_context_lens,
            prefills=prefills,
        )
        lora = None
        if any(slot >= 0 for slot in lora_slots):  # base-only batches skip the LoRA matmuls entirely
            lora = self.lora_slots.for_layers(torch.tensor(lora_slots, dtype=torch.int32, device=self.device))
        # routing is recorded only when a sequence that samples this step asks for it (engine: MoE models only)
        record_routing = any(seq.params.return_routed_experts for seq in sample_seqs)
        hidden, routed = self.model(torch.tensor(input_ids, device=self.device),
                                    torch.tensor(positions, device=self.device), meta, self.kv_caches, lora,
                                    record_routing)
        prompt_logits = [PromptLogits(seq, start, self.model.compute_logits(hidden[row:row + rows]))
                         for seq, row, start, rows in prompt_chunks]
        prompt_hidden = [PromptHiddenStates(seq, start, self.model.final_norm(hidden[row:row + rows]).float().cpu())
                         for seq, row, start, rows in hidden_chunks]
        if not sample_rows:
            return StepOutput(torch.empty(0, self.model.arch.vocab_size), [], prompt_logits, None, prompt_hidden)
        rows = torch.tensor(sample_rows, device=self.device)
        normed = self.model.final_norm(hidden[rows])
        wants_hidden = any(seq.params.return_hidden_states for seq in sample_seqs)
        return StepOutput(self.model.logits_of_normed(normed), sample_seqs, prompt_logits,
                          normed.float().cpu() if wants_hidden else None, prompt_hidden,
                          None if routed is None else routed[rows].cpu())
