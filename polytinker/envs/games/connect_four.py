"""Connect four on a 6x7 board: two players, turn-based, zero-sum. ``player_0`` plays X first.

A move is a column number 1 to 7; the piece falls to the lowest empty row. Four in a line wins
(+1 / -1); a full board is a draw.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.games._grid import longest_line_through
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID, PolicyInput

ROWS, COLS = 6, 7
MARKS = ("X", "O")


def drop(board: list[list[str]], col: int, mark: str) -> tuple[list[list[str]], int]:
    """A copy of ``board`` with ``mark`` dropped in ``col`` (row 0 is the top), and its row."""
    new = [row.copy() for row in board]
    for r in range(ROWS - 1, -1, -1):
        if not new[r][col]:
            new[r][col] = mark
            return new, r
    raise ValueError(f"column {col + 1} is full")


def wins_at(board: list[list[str]], row: int, col: int) -> bool:
    """Whether the piece at (row, col) completes four in a line (only lines through it can)."""
    return longest_line_through(board, row, col) >= 4


def wins_by_dropping(board: list[list[str]], col: int, mark: str) -> bool:
    after, row = drop(board, col, mark)
    return wins_at(after, row, col)


class ConnectFourHeuristic(ScriptedPolicy):
    """Win now, else block the opponent's win, else avoid giving one away, preferring the centre."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        board, me = view["board"], view["mark"]
        other = MARKS[1 - MARKS.index(me)]
        cols = [int(m) - 1 for m in inp.observation.legal_moves]
        for mark in (me, other):
            for c in cols:
                if wins_by_dropping(board, c, mark):
                    return str(c + 1)
        safe = [c for c in cols if not self._gives_win(board, c, me, other)] or cols
        best = min(abs(c - COLS // 2) for c in safe)
        return str(self.rng.choice([c for c in safe if abs(c - COLS // 2) == best]) + 1)

    @staticmethod
    def _gives_win(board: list[list[str]], col: int, me: str, other: str) -> bool:
        after, _ = drop(board, col, me)
        return any(not after[0][c] and wins_by_dropping(after, c, other) for c in range(COLS))


class ConnectFourEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {
        "name": "connect_four_v0",
        "render_modes": ["ansi"],
        "is_parallelizable": False,
    }
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy, "heuristic": ConnectFourHeuristic}

    def __init__(self, config: Any = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self.board = [[""] * COLS for _ in range(ROWS)]
        self._turn = 0
        self._won = ""

    def instructions(self, agent: AgentID) -> str:
        mark = MARKS[self.possible_agents.index(agent)]
        return (
            f"You play connect four as {mark} on a board of 6 rows and 7 columns. X moves first. A piece "
            "dropped in a column falls to the lowest empty row. Four of your pieces in a row, column or "
            "diagonal win. On your turn, answer with a column number from 1 to 7, for example: 4"
        )

    def _new_game(self) -> None:
        self.board = [[""] * COLS for _ in range(ROWS)]
        self._turn = 0
        self._won = ""

    def _current_agent(self) -> AgentID:
        return self.possible_agents[self._turn % 2]

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if agent != self._current_agent() or self._is_over():
            return ()
        return tuple(str(c + 1) for c in range(COLS) if not self.board[0][c])

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        mark = MARKS[self.possible_agents.index(agent)]
        self.board, row = drop(self.board, int(move) - 1, mark)
        self._turn += 1
        if wins_at(self.board, row, int(move) - 1):
            self._won = mark
            return {a: (1.0 if MARKS[i] == mark else -1.0) for i, a in enumerate(self.possible_agents)}
        return {}

    def _is_over(self) -> bool:
        return bool(self._won) or all(self.board[0])

    def _render(self, agent: AgentID) -> str:
        lines = [" ".join(c or "." for c in row) for row in self.board]
        lines.append(" ".join(str(c + 1) for c in range(COLS)))
        mark = MARKS[self.possible_agents.index(agent)]
        if self._is_over():
            status = "Draw." if not self._won else ("You won." if self._won == mark else "You lost.")
        elif agent == self._current_agent():
            status = f"Your turn ({mark}). Open columns: {', '.join(self.legal_moves(agent))}."
        else:
            status = f"Waiting for the other player (you are {mark})."
        return "\n".join(lines) + "\n" + status

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {"board": [row.copy() for row in self.board], "mark": MARKS[self.possible_agents.index(agent)]}
