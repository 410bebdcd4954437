"""Drive an LLMEngine synchronously in tests: submit requests, step until done, collect per-choice results."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.layers.attention import AttentionMetadata, PrefillBatch
from tritonllm.engine.llm_engine import LLMEngine, Request
from tritonllm.engine.processing.outputs import RequestOutput

_ids = itertools.count()

# Engines compared token for token with transformers run in float32 whatever the machine would pick.
EXACT = {"dtype": "float32", "weight_format": "float32", "prefill_dtype": "float32"}


def prefill_hidden(model, token_ids: list[int]) -> torch.Tensor:
    """A model's (any registered class) final hidden states at every position of one prompt, computed in one prefill
    through the paged attention path, with a fresh KV cache of one token per block in the model's dtype."""
    arch, n, dtype = model.arch, len(token_ids), model.embed_tokens.weight.dtype
    shape = (n, 1, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    positions = torch.arange(n)
    length = torch.tensor([n], dtype=torch.int32)
    meta = AttentionMetadata(positions, 0, None, None,
                             PrefillBatch(torch.zeros(1, dtype=torch.int32), length, length, positions[None]))
    hidden, _ = model(torch.tensor(token_ids), positions, meta, caches)
    return hidden


def prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    """prefill_hidden's positions through the model's final norm and LM head."""
    return model.compute_logits(prefill_hidden(model, token_ids))


def decode_hidden(model, token_ids: list[int]) -> torch.Tensor:
    """prefill_hidden's hidden states, each position computed as a decode row: the prompt fed one token a step."""
    arch, n, dtype = model.arch, len(token_ids), model.embed_tokens.weight.dtype
    shape = (n, 1, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    hidden = []
    for position, token in enumerate(token_ids):
        at = torch.tensor([position])
        meta = AttentionMetadata(at, 1, torch.arange(position + 1)[None],
                                 torch.tensor([position + 1], dtype=torch.int32))
        hidden.append(model(torch.tensor([token]), at, meta, caches)[0])
    return torch.cat(hidden)


class TorchOps(TorchDispatchMode):
    """Records every aten op dispatched on the thread that entered it (dispatch modes are per thread)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class Result:
    request: Request
    outputs: list[RequestOutput] = field(default_factory=list)

    def text(self, index: int = 0) -> str:
        return "".join(c.text for o in self.outputs for c in o.choices if c.index == index)

    def deltas(self, index: int = 0) -> list[str]:
        return [c.text for o in self.outputs for c in o.choices if c.index == index]

    def finish_reason(self, index: int = 0) -> str | None:
        reasons = [c.finish_reason for o in self.outputs for c in o.choices if c.index == index and c.finish_reason]
        assert len(reasons) <= 1, reasons
        return reasons[0] if reasons else None

    def token_ids(self, index: int = 0) -> list[int]:
        return [t for o in self.outputs for c in o.choices if c.index == index for t in c.token_ids]


def generate(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Result]:
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    results = {}
    for prompt, p in zip(prompts, params_list):
        request = Request(f"test-{next(_ids)}", prompt, p)
        engine.add_request(request)
        results[request.request_id] = Result(request)
    while engine.has_unfinished_requests():  # step() does nothing while grammars compile: a short spin
        for output in engine.step():
            results[output.request_id].outputs.append(output)
    assert all(r.outputs and r.outputs[-1].finished for r in results.values())
    return list(results.values())


def assert_idle(engine: LLMEngine) -> None:
    """Nothing in flight (running, waiting or compiling a grammar) and every KV block free."""
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and not engine.has_unfinished_requests()
    assert stats.free_blocks == stats.total_blocks and not engine.outputs.requests


def assert_a_long_prompt_does_not_depend_on_its_chunks_or_its_batch(chunks_of_512: LLMEngine, chunks_of_300: LLMEngine,
                                                                    short_prompts: list[str]) -> None:
    """A 1,300-token prompt alone, beside decoding streams of `short_prompts` (its chunks shortened by their rows and
    moved), and in another engine's chunks of 300: the same seeded tokens; the streams' too, with and without it."""
    long_prompt = torch.randint(1000, 40000, (1300,), generator=torch.Generator().manual_seed(1)).tolist()
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    [alone] = generate(chunks_of_512, [long_prompt], seeded)
    streams = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
               for seed in range(len(short_prompts))]
    streams_alone = generate(chunks_of_512, short_prompts, streams)
    together = generate(chunks_of_512, [*short_prompts, long_prompt], [*streams, seeded])
    [other_chunks] = generate(chunks_of_300, [long_prompt], seeded)
    assert together[-1].token_ids() == alone.token_ids() == other_chunks.token_ids()
    assert [r.token_ids() for r in together[:-1]] == [r.token_ids() for r in streams_alone]
    assert_idle(chunks_of_512)
