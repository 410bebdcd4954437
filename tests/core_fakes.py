"""Model-free stand-ins for unit tests of the core and of output processing: sequences on made-up token ids, a
step that does the engine core's bookkeeping without a model, a LoRA slot pool of tiny tensors, and a tokenizer
whose tokens are arbitrary UTF-8 byte pieces (so a character can be split across tokens)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from tritonllm.engine.core.lora_slots import LoraSlotPool
from tritonllm.engine.core.scheduler import ScheduledSequence, Scheduler
from tritonllm.engine.core.sequence import CoreOutput, CoreRequest, SampledToken, Sequence, SequenceUpdate
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.layers.lora import LoraAdapter

_request_ids = itertools.count()
SAMPLED_TOKEN = 7  # what the fake step "samples": every sequence generates it


def make_sequence(prompt: list[int], params: SamplingParams | None = None,
                  lora: LoraAdapter | None = None) -> Sequence:
    """The one sequence of a new request on `prompt`."""
    params = params or SamplingParams()
    request = CoreRequest(f"req-{next(_request_ids)}", prompt, params, max_tokens=params.max_tokens or 16,
                          lora=lora)
    seq = Sequence(request, 0, torch.Generator())
    request.sequences.append(seq)
    return seq


def distinct_prompt(length: int, start: int) -> list[int]:
    """`length` token ids no other prompt of a test shares (pick non-overlapping `start`s)."""
    return list(range(start, start + length))


def step(scheduler: Scheduler, prompt_budget: int | None = None) -> list[ScheduledSequence]:
    """One engine step with the model left out: schedule (with the pacer's `prompt_budget`), mark the scheduled
    tokens computed and cache their full blocks (as EngineCore.step does), and append SAMPLED_TOKEN to each sequence
    that samples."""
    scheduled = scheduler.schedule(prompt_budget)
    for item in scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.cache_full_blocks(item.seq)
        if samples:
            item.seq.token_ids.append(SAMPLED_TOKEN)
    return scheduled


def planned(scheduled: list[ScheduledSequence]) -> list[tuple[Sequence, int]]:
    return [(item.seq, item.num_new_tokens) for item in scheduled]


def lora_slot_pool(max_loras: int) -> LoraSlotPool:
    """A real slot pool over a one-layer architecture with two-wide projections: slots cost nothing."""
    arch = SimpleNamespace(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, hidden_size=2, intermediate_size=2)
    return LoraSlotPool(arch, max_loras, max_rank=1, dtype=torch.float32, device=torch.device("cpu"))


def adapter(name: str, files: bytes = b"") -> LoraAdapter:
    """An adapter with no weights: enough for slots and prefix-cache salts."""
    return LoraAdapter(name, rank=1, weights={}, files=files)


class PieceTokenizer:
    """Decodes like a byte-level BPE tokenizer: a token is a piece of UTF-8 bytes, text is their concatenation
    decoded with U+FFFD for incomplete characters. Pieces get ids as tests name them; `special` pieces are left
    out of the text with skip_special_tokens. With strips_leading_space it decodes like SentencePiece, which
    drops the space that begins a text (so a word decoded alone loses its space)."""

    def __init__(self, special: tuple[str, ...] = ("<|eos|>",), strips_leading_space: bool = False):
        self.pieces: list[bytes] = []
        self.special_ids = {self.id(piece) for piece in special}
        self.strips_leading_space = strips_leading_space

    def id(self, piece: str | bytes) -> int:
        piece = piece.encode() if isinstance(piece, str) else piece
        if piece not in self.pieces:
            self.pieces.append(piece)
        return self.pieces.index(piece)

    def ids(self, *pieces: str | bytes) -> list[int]:
        return [self.id(piece) for piece in pieces]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        kept = [i for i in token_ids if not (skip_special_tokens and i in self.special_ids)]
        text = b"".join(self.pieces[i] for i in kept).decode("utf-8", errors="replace")
        return text.removeprefix(" ") if self.strips_leading_space else text


def core_output(request_id: str, token_ids: list[int], finish_reason: str | None = None,
                stop_token_id: int | None = None, index: int = 0, num_prompt_tokens: int = 3) -> CoreOutput:
    """What the core emits for one choice that produced `token_ids` this step."""
    tokens = [SampledToken(token_id, -0.5) for token_id in token_ids]
    return CoreOutput(request_id, [SequenceUpdate(index, tokens, finish_reason, stop_token_id)], num_prompt_tokens,
                      0, finished=finish_reason is not None)
