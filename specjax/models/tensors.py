"""Checkpoint tensors read one at a time: a `LazyTensor` knows its shape and stored dtype and
reads its values only when asked, so a loader can check a whole checkpoint before reading any of
it, and hold one tensor at a time in host memory while it converts and places the weights.

Safetensors files are read here directly (`open_safetensors`): the format is an 8-byte header
length, a JSON header of names, dtypes, shapes and byte ranges, then the raw little-endian data.
Reading a tensor is one seek and one `readinto` a fresh numpy array of its size: unlike pages of
a memory map, which count in the process's resident memory until the kernel drops them, nothing
of the file stays once the array is freed. bfloat16 reads as `ml_dtypes.bfloat16`, JAX's own. The
writer (`write_safetensors`) streams the same way: the header first, then each tensor as it is
produced (files the `safetensors` package reads alike).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

# Safetensors dtype names -> numpy dtypes (the ones a checkpoint of weights may hold).
SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # FP8 checkpoints' weights (models/quantized.py)
}
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# Dtypes a model weight may be stored in; anything else in a checkpoint is an error naming it.
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor of `shape` stored as `dtype`, read by `read()` (a fresh array each call).
    `source` names where it comes from, for messages (a checkpoint name, or a few)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]
    source: str
    # read_slice(index) -> the values at `index` (one slice(start, stop) per axis), reading no more
    # than it can help; None: `read()` everything, then index it (see `read_index`).
    read_slice: Callable[[tuple[slice, ...]], np.ndarray] | None = None
    # The format of a tensor kept quantized (a GGUF type, "Q4_K", or "fp8"): `read()` then returns
    # a models.quantized.QuantizedWeight in our layout, `shape` its logical shape, `dtype` the
    # float it stands for; None: a plain array. Such a tensor is read whole (and stacked), never
    # sliced or transposed.
    quantized: str | None = None

    def read_index(self, index: tuple[slice, ...]) -> np.ndarray:
        """The values at `index` (slices with step 1, one per axis; None bounds allowed): what one
        device of a mesh holds. Safetensors files read only those bytes (`bytes_read` counts them)."""
        index = normalize_index(index, self.shape)
        self._whole("by slices")
        if self.read_slice is None:
            return np.ascontiguousarray(self.read()[index])
        return self.read_slice(index)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def _whole(self, what: str) -> None:
        if self.quantized:
            raise ValueError(f"{self.source}: a {self.quantized} tensor is read whole, not {what}")

    def transposed(self) -> LazyTensor:
        """A 2-D tensor's transpose (HF's [out, in] -> our [in, out]); 1-D tensors as they are."""
        if len(self.shape) < 2:
            return self
        self._whole("transposed")
        # A view: placing it (jax.device_put) copies once, into the device's layout.
        return dataclasses.replace(
            self,
            shape=self.shape[::-1],
            read=lambda: self.read().T,
            read_slice=lambda index: np.ascontiguousarray(self.read_index(index[::-1]).T),
        )

    def rows(self, start: int, stop: int) -> LazyTensor:
        """Rows start .. stop - 1 of the first axis (one part of a fused checkpoint tensor)."""
        self._whole("by rows")
        return dataclasses.replace(
            self,
            shape=(stop - start, *self.shape[1:]),
            read=lambda: np.ascontiguousarray(self.read()[start:stop]),
            read_slice=lambda index: self.read_index(
                (slice(start + index[0].start, start + index[0].stop), *index[1:])
            ),
        )

    def interleaved(self, part: int, parts: int = 2) -> LazyTensor:
        """Columns part, part + parts, part + 2 * parts, ... of the last axis (gpt-oss keeps its
        experts' gate and up columns interleaved in one tensor: gate 0, up 0, gate 1, ...). A
        slice of them reads the span of columns that holds it."""
        self._whole("by interleaved columns")
        *lead, columns = self.shape
        if columns % parts:
            raise ValueError(f"{self.source}: {columns} columns do not split into {parts} interleaved parts")

        def read_slice(index):
            *rest, last = index
            span = self.read_index((*rest, slice(last.start * parts, last.stop * parts)))
            return np.ascontiguousarray(span[..., part::parts])

        return dataclasses.replace(
            self,
            shape=(*lead, columns // parts),
            read=lambda: np.ascontiguousarray(self.read()[..., part::parts]),
            read_slice=read_slice,
        )

    def mapped(self, function: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...] | None = None):
        """The tensor with `function` applied to its values when read (shape changed to `shape`)."""
        self._whole("mapped")
        return dataclasses.replace(  # no slice reads: `function` needs the whole tensor
            self,
            shape=self.shape if shape is None else tuple(shape),
            read=lambda: function(self.read()),
            read_slice=None,
        )


def normalize_index(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (slices of step 1, missing trailing axes taken whole) as one slice(start, stop) per
    axis of `shape`, with concrete bounds."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for axis, n in zip(index, shape, strict=True):
        start, stop, step = axis.indices(n)
        if step != 1:
            raise ValueError(f"read_index: slices must have step 1, got {axis}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


_BYTES_READ = [0]  # bytes read from checkpoint files by this process (`bytes_read`)


def bytes_read() -> int:
    """How many bytes this process has read from safetensors files so far (whole tensors and
    slices): what a test of loading on several processes counts."""
    return _BYTES_READ[0]


def of_array(array: np.ndarray, source: str) -> LazyTensor:
    """An array already in memory, as a LazyTensor."""
    array = np.asarray(array)
    return LazyTensor(tuple(array.shape), array.dtype, lambda: array, source, lambda index: array[index])


def stacked(parts: list[LazyTensor], source: str) -> LazyTensor:
    """One tensor [N, ...] from N tensors of one shape (a mixture's per-expert weights), read in turn
    (quantized ones: each field stacked)."""
    first = parts[0]
    if first.quantized:
        return dataclasses.replace(
            first,
            shape=(len(parts), *first.shape),
            read=lambda: jax.tree.map(lambda *fields: np.stack(fields), *(part.read() for part in parts)),
            source=source,
            read_slice=None,
        )

    def read():
        out = np.empty((len(parts), *first.shape), first.dtype)
        for i, part in enumerate(parts):
            out[i] = part.read()
        return out

    def read_slice(index):
        return np.stack([parts[i].read_index(index[1:]) for i in range(index[0].start, index[0].stop)])

    return LazyTensor((len(parts), *first.shape), first.dtype, read, source, read_slice)


def open_safetensors(path: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of one safetensors file by name, unread. ValueError for a file that is not
    safetensors or a dtype this reader does not know."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (header_size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({error})") from None
    data_start = 8 + header_size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which specjax cannot read")
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(int(n) for n in entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} holds {end - begin} bytes, not {shape} of {dtype}")
        offset = data_start + begin
        tensors[name] = LazyTensor(
            shape, dtype, _reader(path, offset, shape, dtype), name, _slice_reader(path, offset, shape, dtype)
        )
    return tensors


def _reader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        out = np.empty(shape, dtype)
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view = memoryview(out.reshape(-1).view(np.uint8))
            done = 0
            while done < len(view):  # readinto may return less than asked
                count = f.readinto(view[done:])
                if not count:
                    raise ValueError(f"{path} ends inside a tensor (truncated file)")
                done += count
        _BYTES_READ[0] += out.nbytes
        return out if np.little_endian else out.byteswap()  # the format is little-endian

    return read


def _slice_reader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype):
    """read_slice for a row-major tensor at `offset` of `path`: one positioned read per contiguous
    run of the slice (a column block of a [D, N] matrix is D runs; a block of rows is one)."""
    strides = [int(np.prod(shape[a + 1 :], dtype=np.int64)) * dtype.itemsize for a in range(len(shape))]

    def read_slice(index: tuple[slice, ...]) -> np.ndarray:
        out = np.empty(tuple(s.stop - s.start for s in index), dtype)
        # Trailing axes taken whole merge into one run with the innermost axis that is not.
        whole = len(shape)
        while whole > 0 and index[whole - 1] == slice(0, shape[whole - 1]):
            whole -= 1
        outer = max(whole - 1, 0)  # axes before the run's first axis: one read per combination
        fd = os.open(path, os.O_RDONLY)
        try:
            for position in np.ndindex(*out.shape[:outer]):
                start = offset + sum((index[a].start + position[a]) * strides[a] for a in range(outer))
                if outer < len(shape):
                    start += index[outer].start * strides[outer]
                view = memoryview(out[position].reshape(-1).view(np.uint8))
                done = 0
                while done < len(view):
                    count = os.preadv(fd, [view[done:]], start + done)
                    if not count:
                        raise ValueError(f"{path} ends inside a tensor (truncated file)")
                    done += count
        finally:
            os.close(fd)
        _BYTES_READ[0] += out.nbytes
        return out if np.little_endian else out.byteswap()

    return read_slice


def write_safetensors(
    path: str | Path, tensors: Mapping[str, LazyTensor], metadata: dict | None = None
) -> None:
    """Write tensors to one safetensors file, reading each LazyTensor only when its turn comes."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, tensor in tensors.items():
            values = np.ascontiguousarray(tensor.read(), dtype=tensor.dtype)
            if values.shape != tensor.shape:
                raise ValueError(f"write_safetensors: {name} read as {values.shape}, declared {tensor.shape}")
            f.write(values.tobytes())
