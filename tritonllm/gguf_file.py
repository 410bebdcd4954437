"""A GGUF file's header read straight from its bytes: its metadata and its tensor table, each tensor a view of the
file's memory map shaped as the `gguf` package's GGUFReader shapes it. GGUFReader makes a numpy view of every
string of the file (a 49k-token vocabulary and its merges: about a million views, seconds); this reads the
strings of an array only where asked (the tokenizer's), and nothing of the tensors' data."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has written v3 since 2023
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# metadata value type → its numpy type (little-endian): u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
# tensor types stored as plain values (GGUFReader's numpy types); the others are blocks, viewed as bytes
_VALUE_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor, with GGUFReader's tensor's fields of the same names."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    n_bytes: int
    data: np.ndarray  # the file's bytes, not read yet: values in the torch order, or blocks as [..., bytes of a row]


@dataclass(frozen=True)
class GgufFile:
    metadata: dict[str, object]  # scalars and numeric arrays (lists); string arrays only where asked
    array_lengths: dict[str, int]  # every array's length, read or not
    tensors: list[GgufTensor]

    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.tensors]


def read_gguf(path: str | Path, string_arrays: tuple[str, ...] = ()) -> GgufFile:
    """The file's metadata (the string arrays named in `string_arrays` read in full) and tensor table."""
    blob = np.asarray(np.memmap(path, mode="r", dtype=np.uint8))  # plain views of the mapping: cheaper to slice
    reader = _Reader(memoryview(blob))
    if reader.take(4) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, tensor_count, metadata_count = reader.unpack("<IQQ")
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF version {version}; versions {_VERSIONS} are read")
    metadata, lengths = {}, {}
    for _ in range(metadata_count):
        key = reader.string()
        (value_type,) = reader.unpack("<I")
        if value_type != _ARRAY:
            metadata[key] = reader.value(value_type)
            continue
        element_type, count = reader.unpack("<IQ")
        lengths[key] = count
        if element_type == _STRING:
            strings = [reader.string() for _ in range(count)] if key in string_arrays else reader.skip_strings(count)
            if strings is not None:
                metadata[key] = strings
        else:
            metadata[key] = reader.values(element_type, count)
    table = []
    for _ in range(tensor_count):
        name = reader.string()
        (dimensions,) = reader.unpack("<I")
        shape = reader.unpack(f"<{dimensions}Q")
        tensor_type, offset = reader.unpack("<IQ")
        table.append((name, shape, GGMLQuantizationType(tensor_type), offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.offset // alignment) * alignment
    tensors = []
    for name, shape, tensor_type, offset in table:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
        torch_order = tuple(reversed(shape))
        item = _VALUE_TYPES.get(tensor_type, np.uint8)
        if item is np.uint8:  # blocks: each row's bytes
            torch_order = (*torch_order[:-1], torch_order[-1] // block_size * type_size)
        start = data_start + offset
        tensors.append(GgufTensor(name, tensor_type, shape, n_bytes,
                                  blob[start:start + n_bytes].view(item).reshape(torch_order)))
    return GgufFile(metadata, lengths, tensors)


class _Reader:
    """Little-endian values from a position that moves on."""

    def __init__(self, data: memoryview):
        self.data, self.offset = data, 0

    def take(self, size: int) -> bytes:
        chunk = bytes(self.data[self.offset:self.offset + size])
        self.offset += size
        return chunk

    def unpack(self, layout: str) -> tuple:
        values = struct.unpack_from(layout, self.data, self.offset)
        self.offset += struct.calcsize(layout)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        return self.take(length).decode("utf-8")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self.data, self.offset)
            self.offset += 8 + length

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        return self.values(value_type, 1)[0]

    def values(self, value_type: int, count: int) -> list:
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF metadata value type {value_type} is not one this reader knows")
        array = np.frombuffer(self.data, dtype=_SCALARS[value_type], count=count, offset=self.offset)
        self.offset += array.nbytes
        return array.tolist()
