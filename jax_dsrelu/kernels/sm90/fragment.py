"""Where a Hopper wgmma accumulator fragment keeps its values, for the epilogues that
walk it value by value.

Within a subtile a thread holds value v = c + 2 h + 4 j of its warp's 16 x (8 J) block at
row 8 h + lane / 4 and column 8 j + 2 (lane % 4) + c: two rows (h = 0, 1) and, in each, the
columns of slots c + 2 j.
"""

from __future__ import annotations


def row_half(value: int) -> int:
    """Which of the thread's two rows value `value` lies in (h)."""
    return (value // 2) % 2


def column_slot(value: int) -> int:
    """Which of the thread's columns value `value` lies in (c + 2 j): both rows share it."""
    return value % 2 + 2 * (value // 4)


def column_offset(slot: int) -> int:
    """Column slot `slot`'s column, less the thread's first (slot 0's): 8 j + c."""
    return 8 * (slot // 2) + slot % 2


def segment(value: int, first_column: int = 0, width: int = 64) -> int:
    """Which `width`-column segment of a tile holds value `value` of a fragment whose
    columns start at the tile's column `first_column` (a multiple of 8): its column is
    first_column + 8 j + 2 (lane % 4) + c, within the 8 of j."""
    return (first_column + 8 * (value // 4)) // width
