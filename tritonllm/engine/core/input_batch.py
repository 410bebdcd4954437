"""A step's model inputs, written into persistent buffers.

The buffers are allocated once, for the largest step the scheduler can make (`max_num_batched_tokens` tokens,
`max_num_seqs` sequences, `max_model_len` tokens of context each), and each step fills a prefix of them from
the schedule on the host (numpy views, no tensor made per step). What the forward pass reads are views of
them: on CUDA device copies, filled from pinned host buffers by non-blocking copies, so the addresses stay the
same from step to step (what a CUDA graph replays) and the forward needs nothing from the host. Reusing the
pinned host buffers is safe because every step ends with its sampled tokens read back, after its copies ran.

The flat batch: one-token queries (decodes) first, then prefill chunks; per sequence a row of the block-table
and context-length buffers, decodes first too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tritonllm.engine.core.scheduler import ScheduledSequence
from tritonllm.engine.core.sequence import Sequence
from tritonllm.engine.layers.attention import AttentionMetadata, PrefillBatch
from tritonllm.kernels.decode_attention import DecodeWorkspace


@dataclass(frozen=True)
class PromptRows:
    """Rows of the flat batch that belong to one sequence's prompt: where they start, and which prompt
    position the first one is."""

    seq: Sequence
    row: int
    start: int
    count: int

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.count)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    attention: AttentionMetadata
    token_lora_slots: torch.Tensor  # [tokens] int32, −1: the base model
    active_lora_slots: tuple[int, ...]  # the slots (≥ 0) the batch uses; empty: no LoRA this step
    sample_rows: torch.Tensor  # [samples]: the row each sampling sequence's next token is predicted from
    sample_seqs: list[Sequence]
    prompt_logprob_rows: list[PromptRows]  # rows predicting a prompt token of a sequence that wants its logprobs
    prompt_hidden_rows: list[PromptRows]  # prompt rows of a sequence that wants their hidden states
    record_routing: bool  # a sampling sequence wants its routed experts
    wants_hidden: bool  # a sampling sequence wants its hidden states


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, decode_workspace: DecodeWorkspace | None):
        self.block_size = block_size
        self.decode_workspace = decode_workspace
        shapes = {"input_ids": ((max_tokens,), torch.int64), "positions": ((max_tokens,), torch.int64),
                  "slot_mapping": ((max_tokens,), torch.int64), "lora_slots": ((max_tokens,), torch.int32),
                  "block_tables": ((max_seqs, max_blocks_per_seq), torch.int64),
                  "context_lens": ((max_seqs,), torch.int32), "query_starts": ((max_seqs,), torch.int32),
                  "query_lens": ((max_seqs,), torch.int32), "sample_rows": ((max_seqs,), torch.int64)}
        on_cuda = device.type == "cuda"
        self._host = {name: torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
                      for name, (shape, dtype) in shapes.items()}
        self._np = {name: tensor.numpy() for name, tensor in self._host.items()}
        self._device = ({name: torch.zeros_like(tensor, device=device) for name, tensor in self._host.items()}
                        if on_cuda else self._host)

    def prepare(self, scheduled: list[ScheduledSequence]) -> StepInputs:
        ordered = sorted(scheduled, key=lambda item: item.num_new_tokens != 1)  # decodes first
        num_decodes = sum(1 for item in ordered if item.num_new_tokens == 1)
        prompt_logprob_rows, prompt_hidden_rows, sample_seqs = [], [], []
        widths = [0, 0]  # blocks covering the longest context: of the decodes, of the prefills
        row = 0
        for index, item in enumerate(ordered):
            seq, start, count = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            self._fill_tokens(seq, row, start, count)
            is_prefill = index >= num_decodes
            width = self._fill_context(index, seq, start + count)
            widths[is_prefill] = max(widths[is_prefill], width)
            if is_prefill:
                self._np["query_starts"][index - num_decodes] = row - num_decodes
                self._np["query_lens"][index - num_decodes] = count
            scored = min(start + count, seq.num_prompt_tokens - 1) - start  # rows that predict a prompt token
            if seq.needs_prompt_logprobs and scored > 0:
                prompt_logprob_rows.append(PromptRows(seq, row, start, scored))
            in_prompt = min(start + count, seq.num_prompt_tokens) - start
            if seq.needs_prompt_hidden_states and in_prompt > 0:
                prompt_hidden_rows.append(PromptRows(seq, row, start, in_prompt))
            row += count
            if item.samples:
                self._np["sample_rows"][len(sample_seqs)] = row - 1
                sample_seqs.append(seq)
        self._copy_to_device(row, len(ordered))
        return StepInputs(
            input_ids=self._device["input_ids"][:row], positions=self._device["positions"][:row],
            attention=self._attention(row, num_decodes, len(ordered), widths),
            token_lora_slots=self._device["lora_slots"][:row],
            active_lora_slots=tuple(sorted({item.seq.lora_slot for item in ordered if item.seq.lora_slot >= 0})),
            sample_rows=self._device["sample_rows"][:len(sample_seqs)], sample_seqs=sample_seqs,
            prompt_logprob_rows=prompt_logprob_rows, prompt_hidden_rows=prompt_hidden_rows,
            record_routing=any(seq.params.return_routed_experts for seq in sample_seqs),
            wants_hidden=any(seq.params.return_hidden_states for seq in sample_seqs))

    def _fill_tokens(self, seq: Sequence, row: int, start: int, count: int) -> None:
        """Token ids, positions, KV slots and LoRA slots of rows [row, row + count)."""
        rows, size = slice(row, row + count), self.block_size
        self._np["input_ids"][rows] = seq.token_ids[start:start + count]
        self._np["lora_slots"][rows] = seq.lora_slot
        if count == 1:  # a decode: no arrays for one token
            self._np["positions"][row] = start
            self._np["slot_mapping"][row] = seq.block_table[start // size] * size + start % size
            return
        positions = np.arange(start, start + count)
        self._np["positions"][rows] = positions
        self._np["slot_mapping"][rows] = np.asarray(seq.block_table)[positions // size] * size + positions % size

    def _fill_context(self, index: int, seq: Sequence, context_len: int) -> int:
        """The sequence's block-table row and context length; returns the blocks that cover its context."""
        width = -(-context_len // self.block_size)
        self._np["block_tables"][index, :width] = seq.block_table[:width]  # the rest: earlier steps' valid ids
        self._np["context_lens"][index] = context_len
        return width

    def _copy_to_device(self, num_tokens: int, num_seqs: int) -> None:
        if self._device is self._host:
            return
        for name, host in self._host.items():
            used = num_tokens if host.shape[0] == self._host["input_ids"].shape[0] else num_seqs
            self._device[name][:used].copy_(host[:used], non_blocking=True)

    def _attention(self, num_tokens: int, num_decodes: int, num_seqs: int, widths: list[int]) -> AttentionMetadata:
        tables, context_lens = self._device["block_tables"], self._device["context_lens"]
        prefill = None
        if num_seqs > num_decodes:
            chunks = slice(num_decodes, num_seqs)
            prefill = PrefillBatch(self._device["query_starts"][:num_seqs - num_decodes],
                                   self._device["query_lens"][:num_seqs - num_decodes],
                                   context_lens[chunks], tables[chunks, :widths[1]])
        return AttentionMetadata(
            slot_mapping=self._device["slot_mapping"][:num_tokens], num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes, :widths[0]] if num_decodes else None,
            decode_context_lens=context_lens[:num_decodes] if num_decodes else None,
            prefill=prefill, decode_workspace=self.decode_workspace)
