"""A GGUF file's header read straight from its bytes: its metadata and its tensor table, and each tensor a view of
the file's memory map shaped as the `gguf` package's GGUFReader shapes it. GGUFReader makes a numpy view of every
string of the file (a 49k-token vocabulary and its merges: about a million views, seconds); this reads the strings
of an array only where asked (the tokenizer's), and nothing of the tensors' data."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has written v3 since 2023
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# metadata value type → its struct code: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor, with GGUFReader's tensor's fields of the same names."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    n_bytes: int
    data: object  # a numpy view of the file, not read yet: values in the torch order, or blocks [..., bytes of a row]
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)  # the file's, which data views
    offset: int = 0  # data's, in the file

    def drop_pages(self) -> None:
        """Takes this tensor's pages out of the process's resident memory: the page cache keeps them, and a later
        read of `data` maps them again. A load that copies each tensor calls it when done with one, so that the file
        is not resident beside its copy (a 1B Q8_0's load peaked at twice the file)."""
        if self.mapping is None:
            return
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(-(-(self.offset + self.n_bytes) // mmap.PAGESIZE) * mmap.PAGESIZE, len(self.mapping))
        self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class GgufFile:
    """The header: read with the standard library alone (the CLI reads it too); the tensors on demand."""

    path: Path
    metadata: dict[str, object]  # scalars and numeric arrays (lists); string arrays only where asked
    array_lengths: dict[str, int]  # every array's length, read or not
    table: list[tuple[str, tuple[int, ...], int, int]]  # per tensor: name, shape, type id, offset in the data
    data_start: int

    def tensor_names(self) -> list[str]:
        return [name for name, *_ in self.table]

    def tensors(self) -> list[GgufTensor]:
        """Each tensor as a view of the file's memory map, shaped as GGUFReader shapes it."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Type

        values = {Type.F16: np.float16, Type.F32: np.float32, Type.F64: np.float64, Type.I8: np.int8,
                  Type.I16: np.int16, Type.I32: np.int32, Type.I64: np.int64}  # the others are blocks: bytes
        with open(self.path, "rb") as file:
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        blob = np.frombuffer(mapping, dtype=np.uint8)  # read-only; plain views are cheaper to slice than memmaps
        tensors = []
        for name, shape, type_id, offset in self.table:
            tensor_type = Type(type_id)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
            torch_order = tuple(reversed(shape))
            item = values.get(tensor_type, np.uint8)
            if item is np.uint8:  # each row's blocks as bytes
                torch_order = (*torch_order[:-1], torch_order[-1] // block_size * type_size)
            start = self.data_start + offset
            tensors.append(GgufTensor(name, tensor_type, shape, n_bytes,
                                      blob[start:start + n_bytes].view(item).reshape(torch_order), mapping, start))
        return tensors


def read_gguf(path: str | Path, string_arrays: tuple[str, ...] = ()) -> GgufFile:
    """The file's metadata (the string arrays named in `string_arrays` read in full) and tensor table."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        reader = _Reader(mapped)
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
                metadata[key] = reader.string() if value_type == _STRING else reader.values(value_type, 1)[0]
                continue
            element_type, count = reader.unpack("<IQ")
            lengths[key] = count
            if element_type != _STRING:
                metadata[key] = reader.values(element_type, count)
            elif key in string_arrays:
                metadata[key] = [reader.string() for _ in range(count)]
            else:
                reader.skip_strings(count)
        table = []
        for _ in range(tensor_count):
            name = reader.string()
            (dimensions,) = reader.unpack("<I")
            shape = reader.unpack(f"<{dimensions}Q")
            tensor_type, offset = reader.unpack("<IQ")
            table.append((name, shape, tensor_type, offset))
        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        return GgufFile(Path(path), metadata, lengths, table, -(-reader.offset // alignment) * alignment)


class _Reader:
    """Little-endian values from a position that moves on."""

    def __init__(self, data):
        self.data, self.offset = data, 0

    def take(self, size: int) -> bytes:
        chunk = self.data[self.offset:self.offset + size]
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

    def values(self, value_type: int, count: int) -> list:
        if value_type not in _SCALARS:
            raise ValueError(f"GGUF metadata value type {value_type} is not one this reader knows")
        return list(self.unpack(f"<{count}{_SCALARS[value_type]}"))
