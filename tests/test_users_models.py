"""bench/users_models.py's shapes: Llama-3.2-1B and 3B as published, with the default model's vocabulary."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is scripts, not a package
import users_models  # noqa: E402

LLAMA_3_VOCAB = 128256
PUBLISHED = {"1b": 1_235_814_400, "3b": 3_212_749_824}  # Llama-3.2-1B and 3B's parameters (tied embeddings)


@pytest.mark.parametrize("shape", sorted(users_models.SHAPES))
def test_shapes_are_llama_3_2s(shape):
    assert users_models.parameter_count(users_models.shape_config(shape, LLAMA_3_VOCAB, {})) == PUBLISHED[shape]


@pytest.mark.parametrize("shape, billions", [("1b", 1.074), ("3b", 2.970)])
def test_with_smollm2s_vocabulary_the_count_is_transformers_own(shape, billions):
    config = users_models.shape_config(shape, 49152, {"bos_token_id": 1, "eos_token_id": 2})
    with torch.device("meta"):  # the shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    count = sum(parameter.numel() for parameter in model.parameters())
    assert users_models.parameter_count(config) == count
    assert round(count / 1e9, 3) == billions
    assert model.config.head_dim == users_models.SHAPES[shape]["head_dim"] and model.config.tie_word_embeddings
