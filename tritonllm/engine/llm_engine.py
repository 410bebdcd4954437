"""The engine's parts, and `LLMEngine`, which runs them all on the caller's thread (tests, benchmarks, offline
use): input processing → engine core → output processing. The Triton model runs the same parts on three
threads instead (tritonllm/model_repository/llm/1/model.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.core.core_messages import AbortAll
from tritonllm.engine.core.engine_core import EngineCore, EngineStats, ModelLimits
from tritonllm.interface.parameters import SamplingParams
from tritonllm.model_files import resolve_model_path
from tritonllm.engine.processing.grammar_compiler import GrammarCompiler
from tritonllm.engine.processing.input_processor import InputProcessor, PromptOptions, eos_token_ids, load_tokenizer
from tritonllm.engine.processing.output_processor import OutputProcessor
from tritonllm.engine.processing.outputs import RequestOutput


@dataclass
class EngineParts:
    """One engine's processing around its core: each part has its own tokenizer, so each can live on its own
    thread. The core itself is not here: it belongs to the thread that runs it."""

    model_dir: Path
    limits: ModelLimits
    inputs: InputProcessor
    outputs: OutputProcessor
    grammars: GrammarCompiler

    @classmethod
    def create(cls, config: EngineConfig,
               start_core: Callable[[Callable[[], EngineCore]], ModelLimits]) -> "EngineParts":
        """`start_core` builds the core where it will run (the Triton model: its CoreLoop's thread, see
        tritonllm/engine/core/core_loop.py; LLMEngine: right here) and returns the model's limits."""
        model_dir = resolve_model_path(config.model_path, link_here=True)  # (a GGUF `serve` left to the engine)
        tokenizer = load_tokenizer(model_dir)
        eos = eos_token_ids(model_dir, tokenizer)
        limits = start_core(lambda: EngineCore(config, model_dir, eos))
        grammars = GrammarCompiler(load_tokenizer(model_dir), limits.vocab_size, eos)
        inputs = InputProcessor(config, limits, tokenizer, grammars)
        return cls(model_dir, limits, inputs, OutputProcessor(load_tokenizer(model_dir), inputs.reasoning_tags),
                   grammars)


@dataclass
class Request:
    request_id: str
    prompt: str | list[int] | list[dict]  # text, token ids or chat messages (see InputProcessor)
    params: SamplingParams
    options: PromptOptions = PromptOptions()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.parts = EngineParts.create(config, start_core=self._build_core)
        self.inputs, self.outputs = self.parts.inputs, self.parts.outputs

    def _build_core(self, build: Callable[[], EngineCore]) -> ModelLimits:
        self.core = build()  # run here, on the caller's thread
        return self.core.limits

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.core.limits.vocab_size

    def add_request(self, request: Request) -> None:
        """Process and queue a request. Raises InvalidRequest (NotFound); the request is then not queued."""
        core_request = self.inputs.process(request.request_id, request.prompt, request.params, request.options)
        self.core.add_request(core_request)
        self.outputs.add_request(request.request_id, core_request.prompt_token_ids, request.params,
                                 request.options.tools, core_request.reasoning_start)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    def abort_all(self) -> None:
        self.core.apply(AbortAll())

    def step(self) -> list[RequestOutput]:
        outputs = []
        for core_output in self.core.step():
            output, stop = self.outputs.process(core_output)
            if stop:
                self.core.abort_request(core_output.request_id, stop)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_work(self) -> bool:
        return self.core.has_work()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.close()
        self.parts.grammars.shutdown()
