"""Random numbers that are a function of integers, not of a generator's history.

On the host :func:`mix_seed` hashes integers into a 63-bit key (splitmix64). On a device
:func:`words` gives a 32-bit word per (row, column), a hash of ``(key, i, j)`` alone, so a
replica, rank or block computes exactly its part (multipliers below 2**31: exact in int64).
"""

from __future__ import annotations

import zlib

import torch

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_ROUNDS = ((16, 0x21F0AAAD), (15, 0x735A2D97))  # (shift, multiplier) of each round
_LAST_SHIFT = 15


def splitmix64(x: int) -> int:
    """One round of splitmix64: a well-mixed 64-bit integer from any 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers (e.g. ``seed, epoch, index``) into one 63-bit seed; order matters."""
    h = 0x1234567
    for p in parts:
        h = splitmix64(h ^ (int(p) & _MASK64))
    return h >> 1  # 63 bits: valid for torch.Generator.manual_seed and numpy


def name_key(name: str) -> int:
    """A layer's qualified name as an integer, the same in every process (unlike ``hash``)."""
    return zlib.crc32(name.encode())


def _hash_(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of every value of ``x`` (int64, values in [0, 2**32)), in place."""
    t = torch.empty_like(x)
    for shift, multiplier in _ROUNDS:
        torch.bitwise_right_shift(x, shift, out=t)
        x.bitwise_xor_(t).mul_(multiplier).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, _LAST_SHIFT, out=t)
    return x.bitwise_xor_(t)


def _line(key: int, first: int, count: int, device) -> torch.Tensor:
    """A random word for each index of ``first .. first + count - 1``, under ``key``."""
    low, high = key & _MASK32, (key >> 32) & _MASK32
    index = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return _hash_(_hash_(index.bitwise_xor_(low)).bitwise_xor_(high))


def row_words(key: int, rows: tuple[int, int], device=None) -> torch.Tensor:
    """A random 32-bit word (int64) for each of ``rows[1]`` rows from ``rows[0]`` under ``key``."""
    return _line(mix_seed(key, 1), rows[0], rows[1], device)


def words(key: int, rows: tuple[int, int], cols: tuple[int, int], device=None) -> torch.Tensor:
    """``(rows[1], cols[1])`` words: entry ``(a, b)`` is the hash of the xor of row
    ``rows[0] + a``'s and column ``cols[0] + b``'s words under ``key``."""
    row = row_words(key, rows, device)
    col = _line(mix_seed(key, 2), cols[0], cols[1], device)
    return _hash_(row[:, None] ^ col[None, :])  # the xor is a new tensor: hashed in place


def threshold(p: float) -> int:
    """The word below which an entry is dropped with probability ``p``."""
    return round(p * (1 << 32))
