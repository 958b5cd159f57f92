"""Tic-tac-toe: two players, turn-based, zero-sum. ``player_0`` plays X and moves first.

Cells are numbered 1 to 9, row by row; a move is a cell number. Win +1, loss -1, draw 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytinker.envs.base import TextAECEnv
from polytinker.envs.opponents import RandomPolicy, ScriptedPolicy
from polytinker.envs.types import AgentID, PolicyInput

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
MARKS = ("X", "O")


def winner(board: list[str]) -> str:
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return ""


class TicTacToeHeuristic(ScriptedPolicy):
    """Win if it can, else block, else centre, corner, side (ties broken at random)."""

    def act(self, agent: AgentID, inp: PolicyInput, view: dict[str, Any]) -> str:
        board, me = list(view["board"]), view["mark"]
        other = MARKS[1 - MARKS.index(me)]
        empty = [i for i in range(9) if not board[i]]
        for mark in (me, other):
            for i in empty:
                trial = board.copy()
                trial[i] = mark
                if winner(trial) == mark:
                    return str(i + 1)
        for group in ((4,), (0, 2, 6, 8), (1, 3, 5, 7)):
            options = [i for i in group if i in empty]
            if options:
                return str(self.rng.choice(options) + 1)
        return str(empty[0] + 1)


class TicTacToeEnv(TextAECEnv):
    metadata: ClassVar[dict[str, Any]] = {"name": "tictactoe_v0", "render_modes": ["ansi"], "is_parallelizable": False}
    scripted: ClassVar[dict[str, type[ScriptedPolicy]]] = {"random": RandomPolicy, "heuristic": TicTacToeHeuristic}

    def __init__(self, config: Any = None, render_mode: str | None = None) -> None:
        self.possible_agents = ["player_0", "player_1"]
        super().__init__(config, render_mode)
        self.board = [""] * 9
        self._turn = 0

    def instructions(self, agent: AgentID) -> str:
        mark = MARKS[self.possible_agents.index(agent)]
        return (
            f"You play tic-tac-toe as {mark}. X moves first. Get three of your marks in a row, column or "
            "diagonal to win. Cells are numbered 1 to 9, row by row from the top left. On your turn, answer "
            "with the number of an empty cell, for example: 5"
        )

    def _new_game(self) -> None:
        self.board = [""] * 9
        self._turn = 0

    def _current_agent(self) -> AgentID:
        return self.possible_agents[self._turn % 2]

    def legal_moves(self, agent: AgentID) -> tuple[str, ...]:
        if agent != self._current_agent() or self._is_over():
            return ()
        return tuple(str(i + 1) for i in range(9) if not self.board[i])

    def _apply(self, agent: AgentID, move: Any) -> dict[AgentID, float]:
        mark = MARKS[self.possible_agents.index(agent)]
        self.board[int(move) - 1] = mark
        self._turn += 1
        won = winner(self.board)
        if not won:
            return {}
        return {a: (1.0 if MARKS[i] == won else -1.0) for i, a in enumerate(self.possible_agents)}

    def _is_over(self) -> bool:
        return bool(winner(self.board)) or all(self.board)

    def _render(self, agent: AgentID) -> str:
        cells = [c or str(i + 1) for i, c in enumerate(self.board)]
        rows = [" " + " | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
        board = "\n---+---+---\n".join(rows)
        mark = MARKS[self.possible_agents.index(agent)]
        if self._is_over():
            won = winner(self.board)
            status = "Draw." if not won else ("You won." if won == mark else "You lost.")
        elif agent == self._current_agent():
            status = f"Your turn ({mark}). Empty cells: {', '.join(self.legal_moves(agent))}."
        else:
            status = f"Waiting for the other player (you are {mark})."
        return f"{board}\n{status}"

    def view(self, agent: AgentID) -> dict[str, Any]:
        return {"board": list(self.board), "mark": MARKS[self.possible_agents.index(agent)]}
