"""gomoku-v0: the PettingZoo contract, lines won at the board's edges, draws, coordinates and
hostile text, the scripted opponents' strength, seeded repeatability."""

from __future__ import annotations

import random
import warnings

import pytest
from pettingzoo.test import api_test

from polytinker.envs import Coordinator, EnvConfig, InvalidAction, check_env, make
from polytinker.envs.games.gomoku import GomokuWeak, heuristic_cell, read_cell
from polytinker.envs.opponents import scripted_policy
from polytinker.errors import ConfigError


def _play_moves(env, moves):
    for move in moves:
        assert env.agents and not env.terminations[env.agent_selection], f"the game ended before {move}"
        env.step(move)


def _games(kinds, n=50, **kwargs):
    env = make("gomoku-v0", **kwargs)
    seats = zip(env.possible_agents, kinds, strict=True)
    policies = {a: scripted_policy(env, k, seed=i) for i, (a, k) in enumerate(seats)}
    return Coordinator().run_sync(lambda: make("gomoku-v0", **kwargs), policies, range(n))


@pytest.mark.parametrize("kwargs", [{"size": 5, "win_length": 3}, {"size": 9}])
def test_pettingzoo_api_test_and_conformance_on_other_boards(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(make("gomoku-v0", **kwargs), num_cycles=200)
    failed = [f for f in check_env(lambda: make("gomoku-v0", **kwargs)) if not f.passed]
    assert not failed, failed


def test_defaults_and_arguments_are_validated():
    env = make("gomoku-v0")
    assert (env.size, env.win_length) == (7, 4)
    assert make("gomoku-v0", size=9).win_length == 5
    assert make("gomoku-v0", size=15, win_length=5).size == 15
    for bad in ({"size": 2}, {"size": 20}, {"size": True}, {"size": "7"}, {"size": 7.0}):
        with pytest.raises(ConfigError, match="size"):
            make("gomoku-v0", **bad)
    for bad in ({"win_length": 2}, {"size": 5, "win_length": 6}, {"win_length": 4.0}):
        with pytest.raises(ConfigError, match="win_length"):
            make("gomoku-v0", **bad)


# Each line ends at an edge or a corner of the 7x7 board; X plays it with its last mark inside.
LINES = {
    "top row, right edge": ["d1", "g1", "e1", "f1"],
    "bottom row, left edge": ["a7", "d7", "b7", "c7"],
    "left column, top corner": ["a1", "a4", "a2", "a3"],
    "right column, bottom corner": ["g7", "g4", "g6", "g5"],
    "diagonal into the bottom right corner": ["g7", "d4", "f6", "e5"],
    "diagonal from the top left corner": ["a1", "d4", "b2", "c3"],
    "anti-diagonal from the top right corner": ["g1", "d4", "f2", "e3"],
    "anti-diagonal into the bottom left corner": ["a7", "d4", "b6", "c5"],
}
FILLER = ["c2", "e6", "b5", "f3"]  # O's replies: on none of the lines above, and no line of O's own


@pytest.mark.parametrize("line", sorted(LINES))
def test_a_line_of_four_wins_at_the_edges(line):
    env = make("gomoku-v0")
    env.reset(seed=0)
    cells = LINES[line]
    replies = [f for f in FILLER if f not in cells]
    _play_moves(env, [m for pair in zip(cells[:3], replies[:3], strict=True) for m in pair])
    assert not any(env.terminations.values()), "three in a row is not a win"
    env.step(cells[3])
    assert all(env.terminations.values())
    assert env._cumulative_rewards == {"player_0": 1.0, "player_1": -1.0}
    assert "You won." in env.observe("player_0")["text"] and "You lost." in env.observe("player_1")["text"]


def test_o_wins_too_and_a_broken_line_does_not():
    env = make("gomoku-v0")
    env.reset(seed=1)
    # X: a1 c1 e1 g2 (row 1 broken by gaps); O: b3 c3 d3 e3.
    _play_moves(env, ["a1", "b3", "c1", "c3", "e1", "d3", "g2"])
    assert not any(env.terminations.values())
    env.step("e3")
    assert env._cumulative_rewards == {"player_0": -1.0, "player_1": 1.0}
    assert sum(env._cumulative_rewards.values()) == 0.0


def test_a_line_longer_than_win_length_wins():
    env = make("gomoku-v0")
    env.reset(seed=0)
    # X: a1 b1 d1 e1 (runs of two), then c1 joins them into five; O answers on row 7 with gaps.
    _play_moves(env, ["a1", "a7", "b1", "c7", "d1", "e7", "e1", "g7"])
    assert not any(env.terminations.values())
    env.step("c1")
    assert env._cumulative_rewards["player_0"] == 1.0


def _drawn_pattern(size):
    """Marks in pairs along each row, shifted by two every row: no three in a line anywhere."""
    marks = {(r, c): "X" if (c + 2 * r) % 4 < 2 else "O" for r in range(size) for c in range(size)}
    if sum(m == "X" for m in marks.values()) < (size * size + 1) // 2:
        marks = {cell: "O" if m == "X" else "X" for cell, m in marks.items()}
    return marks


def test_a_full_board_without_a_line_is_a_draw():
    env = make("gomoku-v0")
    env.reset(seed=0)
    marks = _drawn_pattern(7)
    xs = [f"{chr(97 + c)}{r + 1}" for (r, c), m in sorted(marks.items()) if m == "X"]
    os_ = [f"{chr(97 + c)}{r + 1}" for (r, c), m in sorted(marks.items()) if m == "O"]
    assert (len(xs), len(os_)) == (25, 24)
    _play_moves(env, [m for pair in zip(xs, [*os_, None], strict=True) for m in pair if m])
    assert all(env.terminations.values())
    assert env._cumulative_rewards == {"player_0": 0.0, "player_1": 0.0}
    assert "Draw" in env.observe("player_1")["text"] and env.legal_moves("player_1") == ()


def test_coordinates_are_read_anywhere_in_the_text_and_the_last_wins():
    assert read_cell("c3", 7) == (2, 2)
    assert read_cell("  I play C3.", 7) == (2, 2)
    assert read_cell("not c3 but (d4)", 7) == (3, 3)
    assert read_cell("e07!", 7) == (6, 4)
    assert read_cell("My move: g1", 7) == (0, 6)
    assert read_cell(" A 3", 7) == (2, 0) and read_cell("(b, 3)", 7) == (2, 1) and read_cell("c-3.", 7) == (2, 2)
    for text, reason in [
        ("h1", "outside the board"),
        ("a8", "outside the board"),
        ("c0", "outside the board"),
        ("hello", "column letter"),
        ("abc3", "column letter"),  # a word, not a coordinate
        ("c3po", "column letter"),
        ("c1234", "column letter"),
        ("I have a 3 in a row", "column letter"),  # spaced forms only as the whole answer
        ("3c3", "column letter"),
        ("\u212a3", "column letter"),  # the Kelvin sign is no k, even on a board with a column k
        ("ſ3", "column letter"),
    ]:
        refused = read_cell(text, 7 if "outside" in reason else 19)
        assert isinstance(refused, InvalidAction) and reason in refused.reason, (text, refused)


def test_occupied_cells_are_refused_with_the_reason_and_legal_moves_parse_back():
    env = make("gomoku-v0")
    env.reset(seed=0)
    legal = env.legal_moves("player_0")
    assert len(legal) == 49 and legal[0] == "a1" and legal[-1] == "g7"
    assert all(env.parse_action("player_0", m) == read_cell(m, 7) for m in legal)
    env.step("d4")
    refused = env.parse_action("player_1", "D4")
    assert isinstance(refused, InvalidAction) and "taken by X" in refused.reason
    text = env.observe("player_1")["text"]
    assert "  a b c d e f g" in text and "4 . . . X . . ." in text and "Last move: X at d4." in text


HOSTILE = [
    "",
    "   ",
    "\x00\x01\x02",
    "ſ3",  # the long s matches [a-z] under IGNORECASE without ASCII
    "\u212a3",  # the Kelvin sign, likewise
    "c³",
    "c\u0663",  # an Arabic-Indic digit three
    "d4" * 400,  # longer than max_action_chars
    "9" * 500,
    "🙂 e5 🙂",
    "\n".join(["a1"] * 100),
    None,
    12,
    b"c3",
    ["c3"],
]


def test_hostile_actions_are_refused_or_played_and_never_crash():
    env = make("gomoku-v0", config=EnvConfig(max_retries=1))
    env.reset(seed=0)
    space = env.observation_space("player_0")
    for action in HOSTILE * 3:
        if not env.agents:
            break
        agent = env.agent_selection
        if env.terminations[agent]:
            env.step(None)
            continue
        result = env.parse_action(agent, action)
        assert isinstance(result, InvalidAction | tuple), (action, result)
        env.step(action)
        assert all(space.contains(env.observe(a)) for a in env.agents)
    assert sum(cell != "" for row in env.board for cell in row) > 0  # fallbacks and e5/a1 were played


def test_heuristic_wins_blocks_and_answers_threats():
    rng = random.Random(0)

    def board(marks):
        grid = [[""] * 7 for _ in range(7)]
        for name, mark in marks.items():
            cell = read_cell(name, 7)
            assert not isinstance(cell, InvalidAction)
            grid[cell[0]][cell[1]] = mark
        return grid

    # A win now beats blocking the opponent's.
    b = board({"a1": "X", "b1": "X", "c1": "X", "a3": "O", "b3": "O", "c3": "O"})
    assert heuristic_cell(b, "X", 4, rng) == (0, 3)
    # Otherwise block: O threatens d3 (a3 b3 c3 _), which outweighs X's own double threat at d6.
    b = board({"b6": "X", "c6": "X", "a3": "O", "b3": "O", "c3": "O"})
    assert heuristic_cell(b, "X", 4, rng) == (2, 3)
    # Block an open two before it becomes an open three (two winning cells at once), even where a
    # cell like a4 would score more for blocking and building at once (then O's e4 wins at b4 or f4).
    b = board({"a1": "X", "a2": "X", "c4": "O", "d4": "O"})
    assert heuristic_cell(b, "X", 4, rng) in {(3, 1), (3, 4)}
    # Make a double threat (b5: b4-b5-b6 open at b3 and b7) before blocking O's open two (d3 d4).
    b = board({"b4": "X", "b6": "X", "d3": "O", "d4": "O"})
    assert heuristic_cell(b, "X", 4, rng) == (4, 1)
    # The first move takes the centre; a full board has no move to choose.
    assert heuristic_cell(board({}), "X", 4, rng) == (3, 3)
    full = [[_drawn_pattern(7)[(r, c)] for c in range(7)] for r in range(7)]
    with pytest.raises(ValueError, match="full"):
        heuristic_cell(full, "O", 4, rng)


def test_heuristic_beats_random_in_both_seats():
    as_o = _games(["random", "heuristic"])
    as_x = _games(["heuristic", "random"])
    assert sum(r.total_rewards["player_1"] > 0 for r in as_o) >= 45
    assert sum(r.total_rewards["player_0"] > 0 for r in as_x) >= 45


def test_heuristic_beats_weak_and_weak_beats_random_less_often():
    as_o = _games(["weak", "heuristic"])
    assert sum(r.total_rewards["player_1"] > 0 for r in as_o) >= 40
    vs_random = _games(["random", "weak"], n=100)
    random_wins = sum(r.total_rewards["player_0"] > 0 for r in vs_random)
    weak_wins = sum(r.total_rewards["player_1"] > 0 for r in vs_random)
    assert 3 <= random_wins < weak_wins, (random_wins, weak_wins)  # beatable: a learner sees wins
    assert 0 < GomokuWeak.random_move_probability < 1


def test_zero_sum_and_seeded_repeatability():
    def transcript(results):
        return [[(a, t.action) for a, tr in r.trajectories.items() for t in tr.turns] for r in results]

    first, again = _games(["weak", "weak"], n=10), _games(["weak", "weak"], n=10)
    assert transcript(first) == transcript(again)
    assert len({str(t) for t in transcript(first)}) == 10, "different seeds should give different games"
    assert all(sum(r.total_rewards.values()) == pytest.approx(0.0) for r in first)
    env = make("gomoku-v0")
    env.reset(seed=5)
    env.step("c3")
    env.reset(seed=5)
    assert all(cell == "" for row in env.board for cell in row) and env.agent_selection == "player_0"
