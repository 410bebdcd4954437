"""A GGUF's header read by gguf_file (what a GGUF's preparation and load read instead of the `gguf` package's
GGUFReader), and the config and tokenizer a GGUF is prepared with from it (model_files): each the same as the
`gguf` package's reader and transformers' own GGUF loading give, on tiny llama and qwen3 files and the default
model's GGUF; and where a GGUF is prepared."""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Type
from gguf import GGUFReader
from transformers import AutoConfig, AutoTokenizer

from tritonllm import model_files
from tritonllm.gguf_file import GgufFile, read_gguf
from tritonllm.model_files import default_gguf_path, gguf_config, gguf_tokenizer

from gguf_models import MIXED_TYPES, write_tiny_gguf

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
# English, code, digits, whitespace runs, accents, CJK, emoji, and the chat template's special tokens
MIXED_TEXT = ("<|im_start|>user\nHello, world! Ça va? 東京タワー 🚀🤖 x = [i**2 for i in range(10)]  \n\n\t"
              "3.14159 1,000,000 don't CamelCaseWord snake_case_word ÄÖÜ ñ<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module", params=["llama", "qwen3", "default"])
def gguf_path(request, tmp_path_factory) -> Path:
    """A tiny llama GGUF (untied Q6_K head), a tiny qwen3 one (tied embedding), or the default model's own."""
    if request.param == "default":
        return default_gguf_path()
    root = tmp_path_factory.mktemp(f"gguf-file-{request.param}")
    return write_tiny_gguf(root / f"tiny-{request.param}.gguf", request.param, MIXED_TYPES,
                           head=Type.Q6_K if request.param == "llama" else None)


def test_tensors_are_the_gguf_readers(gguf_path):
    theirs, ours = GGUFReader(gguf_path).tensors, read_gguf(gguf_path).tensors()
    assert [tensor.name for tensor in ours] == [tensor.name for tensor in theirs]
    for mine, reference in zip(ours, theirs):
        assert (mine.tensor_type, list(mine.shape), mine.n_bytes) == \
            (reference.tensor_type, list(reference.shape), reference.n_bytes), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name


def _resident_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header: address range, perms, offset, dev, inode, path
            ours = line.endswith(str(path))
        elif ours and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_a_tensors_pages_leave_resident_memory_when_dropped_and_read_the_same_again(gguf_path):
    """A load copies each tensor, then drops its pages: the file is not resident beside its copy."""
    largest = max(read_gguf(gguf_path).tensors(), key=lambda tensor: tensor.n_bytes)
    path = Path(gguf_path).resolve()
    before = np.array(largest.data)  # read: its pages are resident
    assert _resident_kib(path) * 1024 >= largest.n_bytes
    largest.drop_pages()
    assert _resident_kib(path) * 1024 < largest.n_bytes // 2
    assert np.array_equal(largest.data, before)


def test_metadata_is_the_gguf_readers(gguf_path):
    fields = {key: field for key, field in GGUFReader(gguf_path).fields.items() if not key.startswith("GGUF.")}
    gguf = read_gguf(gguf_path, TOKENIZER_ARRAYS)
    string_arrays = {key for key, value in gguf.metadata.items() if isinstance(value, list) and value
                     and isinstance(value[0], str)}
    assert string_arrays <= set(TOKENIZER_ARRAYS)
    assert gguf.metadata == {key: field.contents() for key, field in fields.items()
                             if key in gguf.metadata or key not in gguf.array_lengths}
    assert gguf.array_lengths == {key: len(field.data) for key, field in fields.items() if field.types[0] == 9}
    unread = read_gguf(gguf_path)  # string arrays not asked for: only counted
    assert not set(TOKENIZER_ARRAYS) & set(unread.metadata) and unread.array_lengths == gguf.array_lengths


def test_config_and_tokenizer_are_transformers(gguf_path, tmp_path):
    """What a linked GGUF is prepared with (config.json, tokenizer files) is what transformers' AutoConfig and
    AutoTokenizer make of the file, and the tokenizer splits a mixed text into the same tokens."""
    source = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    theirs_config = AutoConfig.from_pretrained(**source)
    ours_config = AutoConfig.for_model(**gguf_config(read_gguf(gguf_path)))
    unsaved = "_name_or_path"  # where AutoConfig read the file from, which config.json does not hold
    assert type(ours_config) is type(theirs_config)
    assert {key: value for key, value in ours_config.to_dict().items() if key != unsaved} == \
        {key: value for key, value in theirs_config.to_dict().items() if key != unsaved}

    theirs_tokenizer = AutoTokenizer.from_pretrained(**source)
    ours_tokenizer = gguf_tokenizer(gguf_path, ours_config)
    assert type(ours_tokenizer) is type(theirs_tokenizer)
    ids = theirs_tokenizer(MIXED_TEXT)["input_ids"]
    assert ours_tokenizer(MIXED_TEXT)["input_ids"] == ids and len(ids) > 40
    assert ours_tokenizer.decode(ids) == theirs_tokenizer.decode(ids)
    for name, tokenizer, config in (("ours", ours_tokenizer, ours_config), ("theirs", theirs_tokenizer, theirs_config)):
        tokenizer.save_pretrained(tmp_path / name)
        config.save_pretrained(tmp_path / name)
    files = sorted(path.name for path in (tmp_path / "theirs").iterdir())
    assert sorted(path.name for path in (tmp_path / "ours").iterdir()) == files and "tokenizer.json" in files
    _, mismatched, errors = filecmp.cmpfiles(tmp_path / "ours", tmp_path / "theirs", files, shallow=False)
    assert not mismatched and not errors


def test_serve_leaves_a_linked_gguf_to_the_engine_which_prepares_it_alike(tmp_path, monkeypatch):
    """`serve` hands a llama or qwen3 GGUF to the engine as it is (under its directory's name); the engine prepares
    it in its own process, no child, into the files a child's preparation writes."""
    gguf = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "llama", MIXED_TYPES)
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path / "cache"))
    assert model_files.resolve_model(str(gguf), gguf_in_engine=True) == model_files.Model(gguf, "tiny-llama")
    assert not (tmp_path / "cache").exists()
    in_child = model_files.convert_gguf(gguf, tmp_path / "in-child" / "tiny-llama")

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child was started: {args}")

    monkeypatch.setattr(model_files.subprocess, "run", no_child)
    here = model_files.resolve_model_path(str(gguf), link_here=True)
    assert here == model_files.converted_gguf_dir(gguf) and model_files.linked_gguf(here) == gguf
    files = sorted(path.name for path in in_child.iterdir())
    assert sorted(path.name for path in here.iterdir()) == files and "config.json" in files
    _, mismatched, errors = filecmp.cmpfiles(here, in_child, files, shallow=False)
    assert not mismatched and not errors


def test_only_llama_and_qwen3_ggufs_are_linked():
    def header(architecture: str, name: str = "tiny") -> GgufFile:
        return GgufFile(Path("x.gguf"), {"general.architecture": architecture, "general.name": name}, {}, [], 0)

    assert model_files.links_gguf(header("llama")) and model_files.links_gguf(header("qwen3"))
    assert not model_files.links_gguf(header("phi3")) and not model_files.links_gguf(header("qwen3moe"))
    assert not model_files.links_gguf(header("llama", "mistral"))  # transformers reads it as mistral
    assert model_files.gguf_config(header("phi3")) is None
