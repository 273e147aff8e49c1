"""Tile configs of the Triton kernels, one vocabulary in both frameworks: block_q / block_k for
the forward, block_q_dkv / block_k_dkv and block_q_dq / block_k_dq for the two backward kernels,
num_warps / num_stages (and *_bwd) for their launches."""
from __future__ import annotations

import dataclasses

MIN_BLOCK = 16  # smallest tile side a Triton dot accepts


def pow2_at_least(n: int, minimum: int = MIN_BLOCK) -> int:
    """The power of two >= n and >= minimum: tile sides and padded head dims."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def check_launch_fields(blocks, choices: tuple[str, ...] = ()) -> None:
    """The checks every Triton tile config shares: ints; tiles (block_*) powers of two >=
    MIN_BLOCK; num_warps* powers of two; num_stages* >= 1 (None where a field defaults to another).
    `choices`: fields that name a choice (the config checks them itself)."""
    name = type(blocks).__name__
    for f in dataclasses.fields(blocks):
        value = getattr(blocks, f.name)
        if (value is None and f.default is None) or f.name in choices:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}.{f.name}={value!r} must be an int")
        if f.name.startswith("block_") and (value < MIN_BLOCK or value & (value - 1)):
            raise ValueError(f"{name}.{f.name}={value} must be a power of two >= {MIN_BLOCK}")
        if f.name.startswith("num_warps") and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name}.{f.name}={value} must be a power of two >= 1")
        if f.name.startswith("num_stages") and value < 1:
            raise ValueError(f"{name}.{f.name}={value} must be >= 1")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles and launch parameters of the softmax engine's three Triton kernels (both frameworks).

    forward: a program takes block_q query rows and walks key tiles of block_k.
    dK/dV:   a program takes block_k_dkv keys and walks query tiles of block_q_dkv (all GQA heads).
    dQ:      a program takes block_q_dq query rows and walks key tiles of block_k_dq.
    The backward kernels launch with num_warps_bwd, num_stages_bwd. Tiles: powers of two >= 16.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 128
    block_q_dq: int = 128
    block_k_dq: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 2

    def __post_init__(self):
        check_launch_fields(self)

    def fitted(self, q_len: int, kv_len: int) -> "BlockSizes":
        """Shrink tiles that exceed the (power-of-two rounded) sequence they tile."""
        cap_q, cap_k = pow2_at_least(q_len), pow2_at_least(kv_len)
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, cap_q), block_k=min(self.block_k, cap_k),
            block_q_dkv=min(self.block_q_dkv, cap_q), block_k_dkv=min(self.block_k_dkv, cap_k),
            block_q_dq=min(self.block_q_dq, cap_q), block_k_dq=min(self.block_k_dq, cap_k))
