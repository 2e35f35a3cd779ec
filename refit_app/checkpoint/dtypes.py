"""The safetensors format's dtype codes and the torch dtypes that hold them: what the reader can load, what the
writer can store, and the order the writer lays tensors out in."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Every dtype code of the format, in the reference implementation's order (its writer puts the last first), with
# the torch dtype that holds it where this torch has one. F6_* have none in torch; F4 is held two per byte.
_DTYPE_ORDER = (
    ("BOOL", "bool"),
    ("F4", "float4_e2m1fn_x2"),
    ("F6_E2M3", None),
    ("F6_E3M2", None),
    ("U8", "uint8"),
    ("I8", "int8"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("I16", "int16"),
    ("U16", "uint16"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I32", "int32"),
    ("U32", "uint32"),
    ("F32", "float32"),
    ("C64", "complex64"),
    ("F64", "float64"),
    ("I64", "int64"),
    ("U64", "uint64"),
)
DTYPE_CODES: dict[str, torch.dtype] = {
    code: getattr(torch, attr)
    for code, attr in _DTYPE_ORDER
    if attr is not None and isinstance(getattr(torch, attr, None), torch.dtype)
}
"""Safetensors dtype code -> the torch dtype holding it, for every code this torch can hold."""
DTYPE_TO_CODE: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_CODES.items()}
WRITE_RANK = {code: i for i, (code, _) in enumerate(_DTYPE_ORDER)}
"""Code -> its place in the reference order; the writer puts the highest first."""
PACKED_PER_ELEMENT = {"F4": 2}
"""Codes whose torch dtype packs several values in one element: the file's shape counts values, the last
dimension of torch's shape counts elements."""


def torch_shape(code: str, shape: Sequence[int]) -> tuple[int, ...]:
    """A file's shape (in values) as torch's shape of the tensor holding it (in elements)."""
    per = PACKED_PER_ELEMENT.get(code, 1)
    return (*tuple(shape[:-1]), shape[-1] // per) if per > 1 and shape else tuple(shape)


def file_shape(code: str, shape: Sequence[int]) -> list[int]:
    """Torch's shape (in elements) as the file's shape (in values): the inverse of :func:`torch_shape`."""
    per = PACKED_PER_ELEMENT.get(code, 1)
    return [*list(shape[:-1]), shape[-1] * per] if per > 1 and shape else list(shape)
