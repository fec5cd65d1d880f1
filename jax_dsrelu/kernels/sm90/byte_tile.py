"""The swizzled 128 x 128 byte tile through which the sm90 byte passes transpose: the
K-major copy (`k_major_copy_kernel.py`) and the weights' quantizing pass
(`block_quantize_kernel.py`). Imports no CuTe DSL; its functions are traced inline.

Row r of the tile is 128 bytes, eight 16-byte slots, and its chunk c (bytes [16 c, 16 c +
16) of the row it holds) lies at slot c ^ (r // 16). A row's eight chunks are stored by
eight neighbouring threads, a warp's four rows 512 neighbouring bytes: four wavefronts,
the least for 512 bytes. A column is read by eight neighbouring threads, 16 rows each
(`read_column_part`): for each of its rows, a warp's four neighbouring columns in the
eight row ranges r // 16 = 0 .. 7 lie in eight distinct slots, on distinct banks, one
wavefront.
"""

from __future__ import annotations

SIDE = 128  # rows of the tile, and bytes of a row
SLOT = 16  # bytes of a slot: one 16-byte load or store
SLOTS = SIDE // SLOT  # slots of a row (8): the threads storing a row, or reading a column
PART_ROWS = SIDE // SLOTS  # rows of a column part, and of a swizzle range (16)


def slot_of(row, chunk):
    """The index, among the tile's 16-byte slots row after row, of row `row`'s chunk `chunk`."""
    return row * SLOTS + (chunk ^ (row // PART_ROWS))


def read_column_part(tile, column, part, out) -> None:
    """out[i] = the byte of column `column` in row PART_ROWS * part + i, for i < PART_ROWS,
    from `tile` (the tile's bytes row after row)."""
    slot = (column // SLOT) ^ part
    for i in range(PART_ROWS):
        out[i] = tile[(part * PART_ROWS + i) * SIDE + slot * SLOT + column % SLOT]
