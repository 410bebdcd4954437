"""vLLM's /tokenize and /detokenize: the engine's tokenizer through the `llm` model's tokenize_only requests (the
adapter has no tokenizer of its own), so the tokens are exactly the ones a completion or chat would use."""

import uuid

from tritonllm.adapter.errors import AdapterError, model_not_found
from tritonllm.adapter.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from tritonllm.adapter.runtime_lora import RuntimeAdapters
from tritonllm.adapter.triton_client import TritonClient


class TokenizationService:
    def __init__(self, triton: TritonClient, served_model_name: str, runtime_adapters: RuntimeAdapters) -> None:
        self._triton = triton
        self._served_model_name = served_model_name
        self._runtime_adapters = runtime_adapters

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        chat = isinstance(request, TokenizeChatRequest)
        tokenized = await self._call(request.model, request.conversation() if chat else request.prompt,
                                     request.prompt_options(), "messages" if chat else "prompt")
        return TokenizeResponse(count=len(tokenized.token_ids), max_model_len=tokenized.max_model_len,
                                tokens=tokenized.token_ids,
                                token_strs=tokenized.token_strs if request.return_token_strs else None)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        if not request.tokens:  # (the engine takes no empty prompt)
            return DetokenizeResponse(prompt="")
        tokenized = await self._call(request.model, request.tokens, {}, "tokens")
        return DetokenizeResponse(prompt=tokenized.text)

    async def _call(self, model: str | None, prompt: str | list[int] | list[dict],
                    prompt_options: dict[str, bool | str],
                    field: str):
        # Every adapter shares the base model's tokenizer: "<model>:<adapter>" (or a runtime one) tokenizes alike.
        if model is not None and model.partition(":")[0] != self._served_model_name \
                and self._runtime_adapters.path_of(model) is None:
            raise model_not_found(model)
        try:
            return await self._triton.tokenize(prompt, prompt_options, request_id=f"tokenize-{uuid.uuid4().hex}")
        except AdapterError as error:
            if error.status_code == 400 and error.param is None:
                error.param = field  # the engine's message is about the prompt: name the field that held it
            raise
