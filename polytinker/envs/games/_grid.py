"""Lines of marks on a rectangular board: what the k-in-a-row games (connect four, gomoku) share.

A board is a list of rows (row 0 first), each a list of cells: a mark (``"X"``, ``"O"``) or ``""``
when the cell is empty.

- ``DIRECTIONS``: the four line directions (row, column steps): across, down and both diagonals.
- ``longest_line_through(board, row, col)``: the longest unbroken line of the mark at a cell.
- ``windows(rows, cols, length)``: every segment of ``length`` cells in a line (cached per shape),
  the unit a k-in-a-row heuristic scores.
"""

from __future__ import annotations

import functools

Board = list[list[str]]
Cell = tuple[int, int]

DIRECTIONS: tuple[Cell, ...] = ((0, 1), (1, 0), (1, 1), (1, -1))


def longest_line_through(board: Board, row: int, col: int) -> int:
    """Cells of the mark at (row, col) in its longest unbroken line through that cell (itself
    included); only lines through the newest mark can have become a win, so a game checks this."""
    mark = board[row][col]
    if not mark:
        return 0
    rows, cols = len(board), len(board[0])
    best = 1
    for dr, dc in DIRECTIONS:
        run = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < rows and 0 <= c < cols and board[r][c] == mark:
                run += 1
                r, c = r + sign * dr, c + sign * dc
        best = max(best, run)
    return best


@functools.lru_cache(maxsize=32)
def windows(rows: int, cols: int, length: int) -> tuple[tuple[Cell, ...], ...]:
    """Every run of ``length`` consecutive cells along a direction that fits on the board, in a
    fixed order (heuristics iterate them and must stay deterministic)."""
    found = []
    for dr, dc in DIRECTIONS:
        for r in range(rows):
            for c in range(cols):
                end_r, end_c = r + dr * (length - 1), c + dc * (length - 1)
                if 0 <= end_r < rows and 0 <= end_c < cols:
                    found.append(tuple((r + dr * i, c + dc * i) for i in range(length)))
    return tuple(found)


__all__ = ["DIRECTIONS", "Board", "Cell", "longest_line_through", "windows"]
