"""Which (query block, key block) pairs of a prefill mask need computing, worked out on the host.

A mask known at trace time (a numpy [T, T] bool array: a tree's ancestors, look-ahead blocks, any
pattern) is cut into tiles of block_q x block_k. A tile with no kept pair is skipped, a tile with
every pair kept needs no mask, and the tiles in between (the partial ones) are stored once each:
a causal mask at block_q == block_k has a single distinct partial tile, its diagonal.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable:
    """The visits of each query block, in key order, as host arrays. Q query blocks, V the most
    visits any query block makes (at least 1)."""

    kv_block: np.ndarray  # [Q, V] int32: the key blocks visited; past `count`, the last repeated
    count: np.ndarray  # [Q] int32: how many of the V visits are real
    tile: np.ndarray  # [Q, V] int32: each visit's tile in `tiles`; 0 is the all-kept tile
    tiles: np.ndarray  # [P, block_q, block_k] bool: tile 0 all True, then each distinct partial one


def block_table(mask: np.ndarray, block_q: int, block_k: int) -> BlockTable:
    """The BlockTable of mask [T, T] (query t, key u) in tiles of block_q x block_k. Padding keys
    (past T) are dropped; padding queries, whose outputs are cut off, copy the last real query's
    row, so that they change neither which tiles are skipped or full nor how tiles repeat."""
    T = mask.shape[0]
    num_q, num_k = -(-T // block_q), -(-T // block_k)
    padded = np.zeros((num_q * block_q, num_k * block_k), bool)
    padded[:T, :T] = mask
    padded[T:, :T] = mask[T - 1]
    tiles_of = padded.reshape(num_q, block_q, num_k, block_k).transpose(0, 2, 1, 3)  # [Q, K, bq, bk]
    any_kept, all_kept = tiles_of.any(axis=(2, 3)), tiles_of.all(axis=(2, 3))
    tiles = [np.ones((block_q, block_k), bool)]
    seen: dict[bytes, int] = {}
    visits = []
    for qi in range(num_q):
        row = []
        for ki in np.flatnonzero(any_kept[qi]):
            tile = 0
            if not all_kept[qi, ki]:
                key = np.packbits(tiles_of[qi, ki]).tobytes()
                if key not in seen:
                    seen[key] = len(tiles)
                    tiles.append(tiles_of[qi, ki])
                tile = seen[key]
            row.append((ki, tile))
        visits.append(row)
    width = max(1, max(len(row) for row in visits))
    kv_block = np.zeros((num_q, width), np.int32)
    tile = np.zeros((num_q, width), np.int32)
    for qi, row in enumerate(visits):
        if row:  # pad with the last visit: a TPU pipeline then fetches nothing new
            row = row + [row[-1]] * (width - len(row))
            kv_block[qi], tile[qi] = zip(*row, strict=True)
    count = np.array([len(row) for row in visits], np.int32)
    return BlockTable(kv_block=kv_block, count=count, tile=tile, tiles=np.stack(tiles))
