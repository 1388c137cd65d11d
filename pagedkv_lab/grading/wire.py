"""Messages between the checker and the learner process, as data: JSON for the tree,
raw bytes for tensor storages, never pickle (unpickling what a learner's process sends
would run the learner's code in the grader).

A frame is ``>Q`` (the length of the rest), ``>I`` (the header's length), the header
(UTF-8 JSON: ``{"msg": tree, "blobs": [length, ...]}``) and the blobs. In the tree,
``None``, bools, ints, floats (NaN and infinities included), strings and lists are
themselves; everything else is a dict tagged by ``"$"``:

* ``tuple``, ``set``, ``frozenset``, ``deque``, ``dict`` (a list of key-value pairs,
  keys of any kind here), ``bytes`` (a blob);
* ``tensor``: a strided view (``dtype``, ``shape``, ``stride``, ``offset`` in elements,
  ``device``) of a storage (``storages[i]``: a blob of its bytes). Views of one storage
  stay views of one storage: a kernel's write between guard bytes, or into a pool that
  is a view of a larger buffer, comes back where it happened;
* ``ndarray``: a numeric NumPy array (a blob, its dtype and shape);
* ``object``: an instance of a class of :data:`OBJECT_CLASSES` (its attributes);
* ``opaque``: anything else, as its type's name and a short ``repr`` (decoded as an
  :class:`Opaque`, so that a message can say what came back).

:func:`unpack` checks what it builds (known dtypes and classes, views inside their
storage, a nesting depth) and raises :class:`WireError` on anything else.
"""

from __future__ import annotations

import importlib
import json
import struct
from collections import deque

import numpy as np
import torch

__all__ = ["pack", "unpack", "WireError", "Opaque", "OBJECT_CLASSES", "MAX_FRAME_BYTES", "HEAD"]

HEAD = struct.Struct(">Q")  # the length of a frame's rest
_HEADER_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 256 << 20  # a kernel exercise's pools are kilobytes to megabytes; a larger reply is refused
MAX_DEPTH = 64

# Objects whose state crosses as attributes: what the exercises hand a learner's function.
OBJECT_CLASSES = ("pagedkv_lib.allocator.BlockAllocator",)

_OPTIONAL_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")  # not in every torch
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
        *(getattr(torch, n) for n in _OPTIONAL_DTYPES if hasattr(torch, n)),
    )
}
_NP_KINDS = "biufc"  # bool, int, uint, float, complex: never object arrays


class WireError(ValueError):
    """A frame or value that is not one of this module's messages."""


class Opaque:
    """A value that could not cross as data: its type's name and a short ``repr``."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other) -> bool:
        return isinstance(other, Opaque) and (self.type_name, self.text) == (other.type_name, other.text)

    __hash__ = None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _Encoder:
    def __init__(self) -> None:
        self.blobs: list[bytes] = []
        self.storages: dict[tuple, int] = {}
        self.storage_meta: list[dict] = []

    def blob(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1

    def storage(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr(), st.nbytes())
        if key not in self.storages:
            raw = torch.empty(0, dtype=torch.uint8).set_(st.cpu() if t.device.type != "cpu" else st)
            index = self.blob(raw.numpy().tobytes())
            self.storages[key] = len(self.storage_meta)
            self.storage_meta.append({"blob": index, "device": str(t.device)})
        return self.storages[key]

    def tensor(self, t: torch.Tensor) -> dict:
        if t.layout != torch.strided or str(t.dtype).removeprefix("torch.") not in _DTYPES:
            return self.opaque(t)
        t = t.detach()
        return {
            "$": "tensor",
            "storage": self.storage(t),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
        }

    def opaque(self, x) -> dict:
        try:
            text = repr(x)
        except Exception:  # a learner's __repr__ may raise: the type still says something
            text = f"<{type(x).__name__}>"
        return {"$": "opaque", "type": type(x).__name__, "repr": text[:300]}

    def value(self, x, depth: int = 0):
        if depth > MAX_DEPTH:
            return self.opaque(x)
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.value(v, depth + 1) for v in x]
        tags = {tuple: "tuple", set: "set", frozenset: "frozenset", deque: "deque", torch.Size: "tuple"}
        if type(x) in tags:
            return {"$": tags[type(x)], "v": [self.value(v, depth + 1) for v in x]}
        if type(x) is dict:
            return {"$": "dict", "v": [[self.value(k, depth + 1), self.value(v, depth + 1)] for k, v in x.items()]}
        if type(x) is bytes:
            return {"$": "bytes", "blob": self.blob(x)}
        if isinstance(x, torch.Tensor):
            return self.tensor(x)
        if isinstance(x, torch.dtype):
            return {"$": "dtype", "v": str(x).removeprefix("torch.")}
        if isinstance(x, np.generic) and x.dtype.kind in _NP_KINDS:
            return x.item()
        if isinstance(x, np.ndarray) and x.dtype.kind in _NP_KINDS:
            data = np.ascontiguousarray(x)
            blob = self.blob(data.tobytes())
            return {"$": "ndarray", "dtype": data.dtype.str, "shape": list(data.shape), "blob": blob}
        if _qualname(type(x)) in OBJECT_CLASSES:
            state = dict(x.__getstate__())  # the class says what crosses (an allocator: not its lock)
            return {"$": "object", "class": _qualname(type(x)), "state": self.value(state, depth + 1)}
        return self.opaque(x)


def pack(message) -> bytes:
    """One frame holding ``message`` (see the module docstring for what it may hold)."""
    enc = _Encoder()
    tree = enc.value(message)
    header = json.dumps(
        {"msg": tree, "storages": enc.storage_meta, "blobs": [len(b) for b in enc.blobs]}, allow_nan=True
    ).encode()
    rest = _HEADER_LEN.pack(len(header)) + header + b"".join(enc.blobs)
    return HEAD.pack(len(rest)) + rest


class _Decoder:
    def __init__(self, header: dict, blobs: list[bytes], devices: bool) -> None:
        self.blobs, self.devices = blobs, devices
        self.storages = [self._storage(m) for m in _list(header.get("storages", []), "storages")]

    def blob(self, index) -> bytes:
        if not isinstance(index, int) or not 0 <= index < len(self.blobs):
            raise WireError(f"no blob {index!r}")
        return self.blobs[index]

    def _storage(self, meta) -> torch.UntypedStorage:
        if not isinstance(meta, dict):
            raise WireError("a storage is not a dict")
        raw = self.blob(meta.get("blob"))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        device = meta.get("device", "cpu")
        if self.devices and isinstance(device, str) and device != "cpu":
            data = data.to(torch.device(device))
        return data.untyped_storage()

    def tensor(self, node: dict) -> torch.Tensor:
        dtype = _DTYPES.get(node.get("dtype"))
        index, shape, stride, offset = node.get("storage"), node.get("shape"), node.get("stride"), node.get("offset")
        if dtype is None or not isinstance(index, int) or not 0 <= index < len(self.storages):
            raise WireError(f"a tensor of dtype {node.get('dtype')!r} on storage {index!r}")
        ints = [shape, stride]
        if not all(isinstance(v, list) and len(v) <= 16 and all(type(i) is int and i >= 0 for i in v) for v in ints):
            raise WireError("a tensor's shape and stride must be lists of non-negative ints")
        if len(shape) != len(stride) or type(offset) is not int or offset < 0:
            raise WireError("a tensor's shape, stride and offset do not fit together")
        storage = self.storages[index]
        item = torch.empty(0, dtype=dtype).element_size()
        if 0 not in shape:
            last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
            if (last + 1) * item > storage.nbytes():
                raise WireError(f"a view ending at byte {(last + 1) * item} of a storage of {storage.nbytes()}")
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)

    def ndarray(self, node: dict) -> np.ndarray:
        try:
            dtype = np.dtype(node.get("dtype"))
        except TypeError as err:
            raise WireError(f"ndarray dtype {node.get('dtype')!r}") from err
        shape = node.get("shape")
        if (
            not isinstance(shape, list)
            or not all(type(n) is int and n >= 0 for n in shape)
            or dtype.kind not in _NP_KINDS
        ):
            raise WireError(f"an ndarray of {dtype} and shape {shape!r}")
        data = self.blob(node.get("blob"))
        if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise WireError("an ndarray's bytes do not match its shape")
        return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)

    def obj(self, node: dict, depth: int):
        name = node.get("class")
        if name not in OBJECT_CLASSES:
            raise WireError(f"objects of {name!r} do not cross")
        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        state = self.value(node.get("state"), depth + 1)
        if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier() for k in state):
            raise WireError(f"the state of a {cls_name} must be a dict of attribute names")
        obj = cls.__new__(cls)
        obj.__setstate__(state)  # the class rebuilds what did not cross (an allocator's lock)
        return obj

    def value(self, node, depth: int = 0):
        if depth > MAX_DEPTH + 2:
            raise WireError("nested too deeply")
        if node is None or type(node) in (bool, int, float, str):
            return node
        if type(node) is list:
            return [self.value(v, depth + 1) for v in node]
        if type(node) is not dict:
            raise WireError(f"a {type(node).__name__} in the tree")
        tag = node.get("$")
        if tag in ("tuple", "set", "frozenset", "deque"):
            items = [self.value(v, depth + 1) for v in _list(node.get("v"), tag)]
            try:
                return {"tuple": tuple, "set": set, "frozenset": frozenset, "deque": deque}[tag](items)
            except TypeError as err:  # an unhashable item in a set
                raise WireError(str(err)) from err
        if tag == "dict":
            pairs = [_list(p, "a dict item") for p in _list(node.get("v"), "dict")]
            try:
                return {self.value(k, depth + 1): self.value(v, depth + 1) for k, v in (_pair(p) for p in pairs)}
            except TypeError as err:
                raise WireError(str(err)) from err
        if tag == "bytes":
            return bytes(self.blob(node.get("blob")))
        if tag == "tensor":
            return self.tensor(node)
        if tag == "ndarray":
            return self.ndarray(node)
        if tag == "dtype" and node.get("v") in _DTYPES:
            return _DTYPES[node["v"]]
        if tag == "object":
            return self.obj(node, depth)
        if tag == "opaque":
            return Opaque(str(node.get("type", "?"))[:100], str(node.get("repr", ""))[:300])
        raise WireError(f"unknown tag {tag!r}")


def _list(v, what: str) -> list:
    if type(v) is not list:
        raise WireError(f"{what}: a list was expected")
    return v


def _pair(p: list) -> tuple:
    if len(p) != 2:
        raise WireError("a dict item is not a pair")
    return p[0], p[1]


def unpack(rest: bytes, devices: bool = False):
    """The message of a frame's ``rest`` (what follows its :data:`HEAD`). ``devices``:
    put tensors back on the device they were sent from (the learner's side); else every
    tensor arrives on the CPU (the checker compares there). Raises :class:`WireError`."""
    if len(rest) < _HEADER_LEN.size:
        raise WireError("a frame shorter than its header length")
    (n,) = _HEADER_LEN.unpack_from(rest)
    try:
        header = json.loads(rest[_HEADER_LEN.size : _HEADER_LEN.size + n])
    except (ValueError, RecursionError) as err:
        raise WireError(f"a header that is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise WireError("a header that is not a dict")
    lengths = _list(header.get("blobs", []), "blobs")
    if not all(type(n_) is int and n_ >= 0 for n_ in lengths):
        raise WireError("blob lengths must be non-negative ints")
    blobs, at = [], _HEADER_LEN.size + n
    for length in lengths:
        blobs.append(rest[at : at + length])
        at += length
    if at != len(rest):
        raise WireError(f"a frame of {len(rest)} bytes whose parts add up to {at}")
    try:
        return _Decoder(header, blobs, devices).value(header.get("msg"))
    except RecursionError as err:
        raise WireError("nested too deeply") from err
