"""The engine with every op forced onto its Triton kernel (interpreted on CPU) computes what it computes with every op
forced onto its torch reference: the logits each token is chosen from, at every step, and the tokens chosen."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tritonllm import kernels
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.sampler import Sampler
from tritonllm.engine.core.sequence import SampledToken, Sequence
from tritonllm.interface.parameters import SamplingParams
from tritonllm.engine.llm_engine import LLMEngine
from engine_helpers import EXACT, generate
from tiny_models import TOKENIZER_FILES

# SmolLM2's first layers: its trained, peaked attention, at a fifteenth of the interpreter's time per step
NUM_LAYERS = 2
DECODE_STEPS = 16
PROMPTS = ["The capital of France is", "def add(a, b):",
           "Once upon a time, in a land far away, there lived a lighthouse keeper who kept a logbook of every ship "
           "that passed, every storm that came, and every light he saw on the water at night.",
           "1, 2, 3, 4,"]
# Each sampling kernel runs: penalties (all three kinds), logit_bias, the allowed_token_ids bitmask, and top-k /
# top-p / min-p filtering of seeded draws; min_tokens bans EOS with -inf.
PARAMS = [
    SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.8, top_k=40, top_p=0.9, seed=1,
                   frequency_penalty=0.5, presence_penalty=0.3, min_tokens=DECODE_STEPS + 1),
    SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=1.0, min_p=0.05, seed=2, ignore_eos=True,
                   logit_bias={13: 2.0, 30: -5.0}),
    SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True, repetition_penalty=1.1,
                   allowed_token_ids=list(range(28, 1000))),
]
# float32 on both paths (the interpreter's bf16 tl.dot is wrong; on CUDA the attention kernels' dots are IEEE fp32,
# not tf32): the kernels differ from the references only in summation order (attention's online softmax, the norms'
# reductions), which moves these logits (|logit| up to ~75) by at most 3.5e-5 (measured), a few float32 ulps; a
# 1% error in the attention scale moves them by 4e-2, a doubled norm eps by 6e-3.
TOLERANCE = dict(atol=1e-4, rtol=1e-6)


@pytest.fixture(scope="module")
def engine(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    truncated = write_first_layers(default_model_dir, tmp_path_factory.mktemp("truncated") / "SmolLM2-2-layers")
    # 16-token blocks and a 48-token step budget: the long prompt spans blocks and prefills in chunks (the later ones
    # read the earlier ones' KV through the block table) beside the other sequences' first decodes. No prefix
    # cache: the second run must compute its own KV, not reuse the first run's.
    return LLMEngine(EngineConfig(model_path=str(truncated), **EXACT, kv_cache_memory=4 << 20, block_size=16,
                                  max_num_batched_tokens=48, enable_prefix_caching=False))


def write_first_layers(model_dir: Path, target: Path) -> Path:
    """A copy of the model with only its first NUM_LAYERS decoder layers (same embeddings, final norm, tokenizer)."""
    target.mkdir(parents=True)
    config = json.loads((model_dir / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": NUM_LAYERS}))
    kept = {f"model.layers.{i}." for i in range(NUM_LAYERS)}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        save_file({name: weights.get_tensor(name) for name in weights.keys()
                   if not name.startswith("model.layers.") or any(name.startswith(prefix) for prefix in kept)},
                  str(target / "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, target / name)
    return target


class TeacherForcing:
    """Stands in for the engine's sampler and records, per prompt, each step's logits after every adjustment
    (penalties, bias, masks: what the token is chosen from) and the token the sampler chose. Given an earlier run's
    tokens, each sequence then continues with those instead of its own, so both runs feed the model the same inputs
    and a difference in one step's logits cannot change the next step's."""

    def __init__(self, sampler: Sampler, forced: dict[tuple[int, ...], list[int]] | None = None):
        self.sampler, self.adjust, self.forced = sampler, sampler._adjust, forced
        self.logits: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.tokens: dict[tuple[int, ...], list[int]] = {}

    def record_adjusted(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Set in place of the sampler's adjustment step: runs and records it (so its kernels run once a step)."""
        adjusted = self.adjust(logits, seqs)
        for seq, row in zip(seqs, adjusted):
            self.logits.setdefault(prompt_of(seq), []).append(row.cpu())
        return adjusted

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        sampled = self.sampler(logits, seqs)
        for seq, token in zip(seqs, sampled):
            self.tokens.setdefault(prompt_of(seq), []).append(token.token_id)
        if self.forced is None:
            return sampled
        return [dataclasses.replace(token, token_id=self.forced[prompt_of(seq)][seq.num_output_tokens])
                for seq, token in zip(seqs, sampled)]


def prompt_of(seq: Sequence) -> tuple[int, ...]:
    return tuple(seq.request.prompt_token_ids)


def run(engine: LLMEngine, mode: str, forced: dict[tuple[int, ...], list[int]] | None = None) -> TeacherForcing:
    """Generate PROMPTS with every op on its kernel ("1") or its reference ("0"), recording every step."""
    recorder = TeacherForcing(engine.core.sampler, forced)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.core, "sampler", recorder)
        patch.setattr(recorder.sampler, "_adjust", recorder.record_adjusted)
        kernels.force(mode)
        try:
            generate(engine, PROMPTS, PARAMS)
        finally:
            kernels.force("")
    return recorder


def test_kernels_compute_the_logits_and_tokens_of_the_torch_path(engine):
    reference = run(engine, "0")
    ours = run(engine, "1", forced=reference.tokens)
    assert len(reference.logits) == len(PROMPTS)
    for prompt, expected in reference.logits.items():
        assert len(expected) == DECODE_STEPS + 1
        for step, (got, want) in enumerate(zip(ours.logits[prompt], expected, strict=True)):
            torch.testing.assert_close(got, want, **TOLERANCE,
                                       msg=lambda m: f"{engine.tokenizer.decode(prompt)!r}, step {step}: {m}")
        assert ours.tokens[prompt] == reference.tokens[prompt]
