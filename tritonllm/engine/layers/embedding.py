"""The token embedding looked up in a GGUF's blocks: only the rows a step reads are dequantized, so no dense copy
(4 bytes a weight) of what is often the model's largest tensor is held beside its blocks (about a byte a weight as
the kernels' blocks unpacked)."""

from __future__ import annotations

import torch
from torch import nn

from tritonllm.engine.layers.linear import BlockWeight


class BlockEmbedding(nn.Module):
    """nn.Embedding's lookup over blocks: each row the blocks' dequantization (the file's numbers, to the bit).
    `weight` is a meta tensor of the dense shape and dtype, what callers read of an embedding's weight."""

    def __init__(self, blocks: BlockWeight):
        super().__init__()
        self.blocks = blocks
        self.register_buffer("weight", torch.empty(blocks.shape, device="meta"), persistent=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.rows(token_ids).dequantize()
