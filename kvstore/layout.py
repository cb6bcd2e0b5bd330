"""Public name of the entry layout (``from kvstore.layout import KVLayout``): the
code lives in kvstore/core/layout.py."""

from kvstore.core.layout import KVLayout, dtype_name, pack_hf, unpack_hf

__all__ = ["KVLayout", "dtype_name", "pack_hf", "unpack_hf"]
