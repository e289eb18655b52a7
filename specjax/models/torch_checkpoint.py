"""Read a `torch.save` checkpoint (`pytorch_model.bin`, `medusa_lm_head.pt`) without torch.

Published drafters (EAGLE-1 and EAGLE-3 releases, Medusa heads) often ship as torch pickles.
The format (torch >= 1.6) is a zip archive: `<name>/data.pkl`, a pickle whose tensors are calls
of `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and whose storages are
persistent ids ("storage", storage class, key, location, numel) naming the raw little-endian
bytes in `<name>/data/<key>`. An unpickler that knows those few names rebuilds every tensor as a
numpy array; any other global is refused, so loading a checkpoint runs no code from it.
"""

from __future__ import annotations

import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import ml_dtypes
import numpy as np

# torch's storage classes -> the dtype of their elements.
_STORAGES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _Storage:
    def __init__(self, data: bytes, dtype):
        self.array = np.frombuffer(data, dtype=np.dtype(dtype))


def _rebuild_tensor(storage: _Storage, offset, size, stride, *_):
    """A tensor's values: `size` elements from `offset` of its storage, with element `stride`s."""
    itemsize = storage.array.dtype.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage.array[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
    )
    return np.array(view)  # a copy: the storage's buffer is the archive's bytes


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, source: str):
        super().__init__(file)
        self.archive, self.prefix, self.source = archive, prefix, source

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise pickle.UnpicklingError(
            f"{self.source}: refusing to load {module}.{name} (only tensors are read)"
        )

    def persistent_load(self, pid):
        kind, dtype, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"{self.source}: unknown persistent id {kind!r}")
        return _Storage(self.archive.read(f"{self.prefix}/data/{key}"), dtype)


def load_torch_checkpoint(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a torch.save'd dict (a state dict), as numpy arrays, by name."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a torch checkpoint of the zip format (torch >= 1.6 writes it)")
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(names) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {len(names)}")
        prefix = names[0][: -len("/data.pkl")]
        with archive.open(names[0]) as file:
            state = _Unpickler(file, archive, prefix, str(path)).load()
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    return dict(state)
