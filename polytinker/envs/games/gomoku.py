"""Gomoku (k in a row) on a small square board: two players, turn-based, zero-sum.

``player_0`` plays X and moves first, ``player_1`` plays O. A move names an empty cell as a column
letter and a row number (``c3``; row 1 is the top row). ``win_length`` marks in an unbroken row,
column or diagonal win (+1 / -1; a longer line wins too); a full board is a draw (0).

Keyword arguments (``make("gomoku-v0", size=9)``): ``size`` (3 to 19, default 7) and
``win_length`` (3 to ``size``; default 4 below 9x9, 5, standard gomoku, from 9x9 on).

Scripted opponents: ``random``; ``heuristic`` (win now, else block a win, else make or block a
double threat, else the cell that extends and blocks the most lines, near the centre; ties broken
by the seeded generator); ``weak`` (a random legal move four times in five, else the heuristic's:
random play wins about one game in seven against it, where it wins one in three hundred against
a coin-flip mix, so a small model has a chance to win and learning has a signal).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from random import Random
from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.config import EnvConfig
from polytinker.envs.games._grid import Board, Cell, longest_line_through, windows
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID, InvalidAction, PolicyInput
from polytinker.errors import ConfigError

MARKS = ("X", "O")
MAX_SIZE = 19  # columns a..s, as on a go board
# A coordinate as a whole token: a column letter, then a row number. ASCII only, since with
# IGNORECASE alone [a-z] also matches the Kelvin sign and the long s, and \d any script's digits.
_COORDINATE = re.compile(r"(?<![a-z0-9])([a-z])([0-9]{1,3})(?![a-z0-9])", re.IGNORECASE | re.ASCII)
# A whole answer that is only a cell may separate its letter and number ("A 3", "c-3", "(b, 2)");
# inside a sentence, "a 3" is more often an article and a number than a cell.
_WHOLE_ANSWER = re.compile(r"\W*([a-z])[\s,-]{0,2}([0-9]{1,3})\W*", re.IGNORECASE | re.ASCII)
# Line scores of the heuristic: a window (win_length cells in a line) holding k of one player's
# marks and none of the other's is worth _GROWTH**k to the cell that adds to it (attack) or takes
# it away (defence, discounted: at equal stakes, building one's own line comes first).
_GROWTH = 6.0
_DEFENCE = 0.8
_CENTRE = 0.01


def cell_name(row: int, col: int) -> str:
    """``(2, 0)`` -> ``"a3"``: the column letter, then the row number counted from 1."""
    return f"{chr(ord('a') + col)}{row + 1}"


def read_cell(text: str, size: int) -> Cell | InvalidAction:
    """The last coordinate that ``text`` names (an answer usually comes last), on the board or not."""
    whole = _WHOLE_ANSWER.fullmatch(text)
    found = [whole.groups()] if whole else _COORDINATE.findall(text)
    last_column = chr(ord("a") + size - 1)
    if not found:
        return InvalidAction(
            f"name an empty cell as a column letter a-{last_column} and a row number 1-{size}, like c3"
        )
    letter, digits = found[-1]
    row, col = int(digits) - 1, ord(letter.lower()) - ord("a")
    if not (0 <= row < size and 0 <= col < size):
        return InvalidAction(f"{letter.lower()}{digits} is outside the board (columns a-{last_column}, rows 1-{size})")
    return row, col


@dataclass(frozen=True)
class GomokuRules:
    """The board's size and the line length that wins."""

    size: int = 7
    # Cells per side, 3 to 19.
    win_length: int | None = None
    # Marks in a line that win, 3 to size; None: 4 below 9x9, 5 (standard gomoku) from 9x9 on.

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 3 <= self.size <= MAX_SIZE:
            raise ConfigError(f"gomoku: size must be a whole number from 3 to {MAX_SIZE}, got {self.size!r}")
        if self.win_length is None:
            object.__setattr__(self, "win_length", 4 if self.size < 9 else 5)
        length = self.win_length
        if isinstance(length, bool) or not isinstance(length, int) or not 3 <= length <= self.size:
            raise ConfigError(
                f"gomoku: win_length must be a whole number from 3 to size ({self.size}), got {length!r}; "
                "4 suits boards below 9x9, 5 is standard gomoku"
            )

    @property
    def length(self) -> int:
        """``win_length`` resolved (never None after construction)."""
        assert self.win_length is not None
        return self.win_length


def _pick(cells: list[Cell], score: dict[Cell, float], rng: Random) -> Cell:
    """The best-scoring cell, ties broken by ``rng`` over a sorted list (so a seed repeats)."""
    best = max(score.get(c, 0.0) for c in cells)
    return rng.choice(sorted(c for c in cells if score.get(c, 0.0) >= best - 1e-9))


def heuristic_cell(board: Board, me: str, win_length: int, rng: Random) -> Cell:
    """The threat-based choice for ``me``: a win, a block of the opponent's win, a double threat
    (two cells that would win next), a block of the opponent's double threat, else the cell that
    adds to and takes away the most open lines, nearer the centre first."""
    size = len(board)
    other = MARKS[1 - MARKS.index(me)]
    wins: dict[str, set[Cell]] = {me: set(), other: set()}
    # For each empty cell, the cells that would then win for the player who takes it.
    threats: dict[str, dict[Cell, set[Cell]]] = {me: defaultdict(set), other: defaultdict(set)}
    centre = (size - 1) / 2
    score: dict[Cell, float] = {
        (r, c): -_CENTRE * (abs(r - centre) + abs(c - centre))
        for r in range(size)
        for c in range(size)
        if not board[r][c]
    }
    for window in windows(size, size, win_length):
        marks = [board[r][c] for r, c in window]
        gaps = [cell for cell, m in zip(window, marks, strict=True) if not m]
        for player, weight in ((me, 1.0), (other, _DEFENCE)):
            count = marks.count(player)
            if len(gaps) + count != win_length or (count == 0 and player == other):
                continue  # the window holds the other player's marks (dead), or is empty (counted once)
            if count == win_length - 1:
                wins[player].update(gaps)
            elif count == win_length - 2:
                for gap in gaps:
                    threats[player][gap].update(g for g in gaps if g != gap)
            for gap in gaps:
                score[gap] += weight * _GROWTH**count
    empty = list(score)
    if not empty:
        raise ValueError("heuristic_cell: the board is full; there is no move to choose")
    for options in (
        wins[me],
        wins[other],
        {c for c, t in threats[me].items() if len(t) >= 2},
        {c for c, t in threats[other].items() if len(t) >= 2},
    ):
        if options:
            return _pick(list(options), score, rng)
    return _pick(empty, score, rng)


class GomokuHeuristic(ScriptedPolicy):
    """The threat-based opponent (``heuristic_cell``); deterministic up to seeded tie-breaks."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        row, col = heuristic_cell(view["board"], view["mark"], view["win_length"], self.rng)
        return cell_name(row, col)


class GomokuWeak(GomokuHeuristic):
    """The heuristic, except that a seeded draw sends a random legal move instead."""

    # At 0.5, random play won 0.3-0.5% of 400 games against it on 7x7 (too few for a GRPO group
    # of four to see a win); at 0.8, 11-17%, and the heuristic still beats it in 200 of 200 games.
    random_move_probability: ClassVar[float] = 0.8

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        legal = inp.observation.legal_moves
        if legal and self.rng.random() < self.random_move_probability:
            return self.rng.choice(legal)
        return super().act(agent, inp, view)


class GomokuEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "gomoku_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {
        "random": RandomPolicy,
        "heuristic": GomokuHeuristic,
        "weak": GomokuWeak,
    }

    def __init__(
        self,
        config: EnvConfig | None = None,
        render_mode: str | None = None,
        size: int = 7,
        win_length: int | None = None,
    ) -> None:
        self.rules = GomokuRules(size, win_length)
        self.size, self.win_length = self.rules.size, self.rules.length
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self._new_game()

    def instructions(self, agent: AgentID) -> str:
        mark = MARKS[self.possible_agents.index(agent)]
        n = self.size
        return (
            f"You play gomoku as {mark} on a {n}x{n} board. X moves first. Get {self.win_length} of your marks "
            f"in a row, column or diagonal to win. Columns are letters a to {chr(ord('a') + n - 1)}, rows are "
            f"numbers 1 to {n} from the top; '.' is an empty cell. On your turn, answer with one empty cell, "
            "column letter then row number, for example: c3"
        )

    def _new_game(self) -> None:
        self.board: Board = [[""] * self.size for _ in range(self.size)]
        self._turn = 0
        self._won = ""
        self._last: Cell | None = None

    def _current_agent(self) -> AgentID:
        return self.possible_agents[self._turn % 2]

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if agent != self._current_agent() or self._is_over():
            return ()
        n = self.size
        return tuple(cell_name(r, c) for r in range(n) for c in range(n) if not self.board[r][c])

    def _parse_move(self, agent: AgentID, text: str) -> Cell | InvalidAction:
        cell = read_cell(text, self.size)
        if isinstance(cell, InvalidAction):
            return cell
        row, col = cell
        if self.board[row][col]:
            return InvalidAction(f"{cell_name(row, col)} is taken by {self.board[row][col]}; choose an empty cell (.)")
        return cell

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        row, col = move
        mark = MARKS[self.possible_agents.index(agent)]
        self.board[row][col] = mark
        self._turn += 1
        self._last = (row, col)
        if longest_line_through(self.board, row, col) < self.win_length:
            return {}
        self._won = mark
        return {a: (1.0 if MARKS[i] == mark else -1.0) for i, a in enumerate(self.possible_agents)}

    def _is_over(self) -> bool:
        return bool(self._won) or self._turn >= self.size * self.size

    def _board_text(self) -> str:
        width = len(str(self.size))
        header = " " * (width + 1) + " ".join(chr(ord("a") + c) for c in range(self.size))
        rows = [f"{r + 1:>{width}} " + " ".join(cell or "." for cell in self.board[r]) for r in range(self.size)]
        return "\n".join([header, *rows])

    def _render(self, agent: AgentID) -> str:
        mark = MARKS[self.possible_agents.index(agent)]
        lines = [self._board_text()]
        if self._last is not None:
            row, col = self._last
            lines.append(f"Last move: {self.board[row][col]} at {cell_name(row, col)}.")
        if self._is_over():
            lines.append(
                "Draw: the board is full." if not self._won else "You won." if self._won == mark else "You lost."
            )
        elif agent == self._current_agent():
            lines.append(f"Your turn ({mark}): answer with an empty cell.")
        else:
            lines.append(f"Waiting for the other player (you are {mark}).")
        return "\n".join(lines)

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {
            "board": [row.copy() for row in self.board],
            "mark": MARKS[self.possible_agents.index(agent)],
            "win_length": self.win_length,
        }


__all__ = [
    "MARKS",
    "GomokuEnv",
    "GomokuHeuristic",
    "GomokuRules",
    "GomokuWeak",
    "cell_name",
    "heuristic_cell",
    "read_cell",
]
