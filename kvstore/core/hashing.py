"""Token-prefix keys.

``key[0] = xxh3_128(namespace || tokens[0])``, ``key[i] = xxh3_128(key[i-1] || tokens[i])``
with each block's tokens as little-endian int32 bytes, so a key names the whole
prefix up to and including its block. The last, partial block of a prompt is
hashed with a distinct fixed seed: a partial key can never equal a full key.

Nothing here is seeded randomly: keys agree across processes, machines and restarts.
"""

from __future__ import annotations

import array
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np
import xxhash

from kvstore.core.errors import InvalidRequestError

if TYPE_CHECKING:  # layout imports torch; the server hashes without it (checksums, KEY_BYTES)
    from kvstore.core.layout import KVLayout

KEY_BYTES = 16
# What a stored record keeps of a 16-byte namespace fingerprint (``namespace_of``).
NAMESPACE_TAG_BYTES = 8
_FULL_SEED = 0
# Fixed, not random: separates partial-block keys from full-block keys.
_PARTIAL_SEED = 0x6B7673746F7265  # "kvstore"
_HIDDEN_SUFFIX = b"\x00kvstore-hidden"
_INT32_MAX = 2**31 - 1


class BlockKeys(NamedTuple):
    """Keys of a prompt's blocks, in order; the last one is partial iff ``partial``."""

    keys: list[bytes]
    token_counts: list[int]
    partial: bool

    @property
    def ntokens(self) -> int:
        return sum(self.token_counts)


def namespace_of(model_id: str, layout: KVLayout, tp_rank: int = 0, tp_size: int = 1,
                 salt: bytes | str = b"", pp_rank: int = 0, pp_size: int = 1,
                 scope: bytes | str = b"") -> bytes:
    """Fingerprint of everything that makes two caches' bytes interchangeable.

    ``pp_rank``/``pp_size``: a pipeline stage holds only its own layers' KV.
    ``scope``: what else a request's KV depends on beyond its tokens (the vLLM
    connector passes the request's LoRA adapter, multimodal inputs and cache_salt:
    what vLLM's own prefix-cache block hashes carry), so only requests vLLM would
    let share a cached block share an entry."""
    if not 0 <= tp_rank < tp_size:
        raise InvalidRequestError(f"tp_rank {tp_rank} outside 0..{tp_size - 1}")
    if not 0 <= pp_rank < pp_size:
        raise InvalidRequestError(f"pp_rank {pp_rank} outside 0..{pp_size - 1}")
    parts = [model_id.encode(), repr(layout.describe()).encode(),
             f"tp{tp_rank}/{tp_size}".encode(), _as_bytes(salt)]
    # Appended only when set, so keys without them stay what they always were.
    if pp_size > 1:
        parts.append(f"pp{pp_rank}/{pp_size}".encode())
    if scope:
        parts.append(b"scope:" + _as_bytes(scope))
    # Length-prefix each part so ("ab", "c") and ("a", "bc") differ.
    blob = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return xxhash.xxh3_128_digest(blob)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def tokens_to_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian int32 array; rejects ids that do not fit."""
    if hasattr(tokens, "detach"):  # torch tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (list, tuple)):
        fast = _int_list_to_array(tokens)
        if fast is not None:
            if fast.size and int(fast.min()) < 0:
                raise InvalidRequestError("token ids must be in 0..2**31-1")
            return fast.astype("<i4", copy=False)
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:  # ragged nesting, unconvertible objects
        raise InvalidRequestError(f"tokens are not a 1-D integer sequence: {exc}") from exc
    if arr.ndim != 1:
        raise InvalidRequestError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"tokens must be integers, got {arr.dtype}")
    if arr.size and _beyond_int32(arr):
        raise InvalidRequestError("token ids must be in 0..2**31-1")
    return arr.astype("<i4", copy=False)


def _beyond_int32(arr: np.ndarray) -> bool:
    """Is an id of the integer array ``arr`` outside 0..2**31-1? One pass where ids
    are 4 bytes or more: a signed array read as unsigned puts its negative ids above
    the limit too."""
    if arr.dtype.kind == "i":
        if arr.dtype.itemsize < 4:  # (its -1 read as unsigned is below the limit)
            return int(arr.min()) < 0
        arr = arr.view(arr.dtype.str.replace("i", "u"))
    return int(arr.max()) > _INT32_MAX


def _int_list_to_array(tokens: list | tuple) -> np.ndarray | None:
    """Fast path for a Python list of ints (what engines pass): ``array('i')`` converts
    in C, about twice as fast as ``np.asarray``, and refuses floats and ids beyond
    int32. ``None`` sends anything odd to the general path, which names the problem.
    (Python bools are ints here, so ``[True]`` is token 1.)"""
    try:
        return np.frombuffer(array.array("i", tokens), dtype=np.int32)
    except (TypeError, OverflowError):
        return None


def block_keys(namespace: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int,
               include_partial: bool = True) -> BlockKeys:
    """Chained keys of every block of ``tokens`` (and of the partial rest, if asked)."""
    return _chained_keys(namespace, tokens_to_array(tokens).tobytes(), block_tokens,
                         include_partial)


def prompt_blocks(namespace: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int,
                  native: Callable[..., tuple[list[bytes], list[bytes], int] | None] | None
                  = None) -> tuple[BlockKeys, list[bytes], int]:
    """``block_keys`` (partial block included), ``block_token_bytes`` and the token
    count of one prompt, its tokens checked and converted once (an insert's and a
    select's first step: each conversion checks every id). ``native``: the client
    extension's ``prompt_keys`` (``kvstore.client.shm.PROMPT_KEYS``, passed in by the
    client: core imports nothing above it), all of this in one C call for the input it
    reads; for the rest it answers None and the Python path below runs."""
    if native is not None and type(block_tokens) is int and 0 < block_tokens <= _INT32_MAX:
        done = native(namespace, tokens, block_tokens, _PARTIAL_SEED)
        if done is not None:  # (None: odd input, which the path below names)
            keys, blocks, ntokens = done
            full, rest = divmod(ntokens, block_tokens)
            return (BlockKeys(keys, [block_tokens] * full + ([rest] if rest else []),
                              bool(rest)), blocks, ntokens)
    raw = tokens_to_array(tokens).tobytes()
    return (_chained_keys(namespace, raw, block_tokens, True),
            _per_block(raw, block_tokens), len(raw) // 4)


def _chained_keys(namespace: bytes, raw: bytes, block_tokens: int, include_partial: bool
                  ) -> BlockKeys:
    """``block_keys`` of the int32 LE token bytes ``raw``."""
    if len(namespace) != KEY_BYTES:
        raise InvalidRequestError(f"namespace must be {KEY_BYTES} bytes")
    step = block_tokens * 4
    full, rest = divmod(len(raw) // 4, block_tokens)
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    prev = namespace
    for start in range(0, full * step, step):
        prev = digest(prev + raw[start:start + step])
        keys.append(prev)
    counts = [block_tokens] * full
    partial = bool(rest) and include_partial
    if partial:
        keys.append(digest(prev + raw[full * step:], _PARTIAL_SEED))
        counts.append(rest)
    return BlockKeys(keys, counts, partial)


def block_token_bytes(tokens: Sequence[int] | np.ndarray, block_tokens: int) -> list[bytes]:
    """Each block's token ids as int32 LE bytes; entries store these to re-check hits."""
    return _per_block(tokens_to_array(tokens).tobytes(), block_tokens)


def _per_block(raw: bytes, block_tokens: int) -> list[bytes]:
    step = block_tokens * 4
    return [raw[i:i + step] for i in range(0, len(raw), step)]


def hidden_key(last_key: bytes) -> bytes:
    """Key of the optional hidden-state tensor that travels with a prompt's last entry."""
    return xxhash.xxh3_128_digest(last_key + _HIDDEN_SUFFIX)


def checksum(data) -> int:
    """xxh3_64 of a buffer (bytes, memoryview, or a contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(data)


def checksummer() -> xxhash.xxh3_64:
    """``checksum`` fed in pieces, in order (``update``, then ``intdigest``)."""
    return xxhash.xxh3_64()
