"""Cross-play's parts that need no model: the Elo fit on hand-checked cases, the outcome of an
episode for the row player, the table's file and rendering, and the league's frozen opponents.
The whole of it on a runtime: tests/test_train_loop.py (in process) and tests/test_league_example.py
(examples/league.py as a user runs it)."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from polytinker.agents import AgentSpec, MappingConfig, PolicyMapping, Slot, SlotKind
from polytinker.agents.crossplay import CROSS_PLAY_FILE, CrossPlay, Record, _record, elo_ratings, entrants
from polytinker.agents.rollout import Players
from polytinker.agents.show import show_run
from polytinker.envs.types import EpisodeResult, Trajectory
from polytinker.errors import ConfigError

ELO_3_TO_1 = 400 * math.log10(3)  # P = 0.75: 10^(d/400) = 0.75 / 0.25, so d = 190.85


def test_elo_of_two_players_is_the_logit_of_the_score_share():
    """3 wins, 1 loss: P = 3/4, so the ratings differ by 400 log10(3); their mean is 1000."""
    elo = elo_ratings([("a", "b", Record(wins=3, losses=1))], prior_draws=0)
    assert elo["a"] - elo["b"] == pytest.approx(ELO_3_TO_1, abs=1e-6)  # 190.85
    assert (elo["a"] + elo["b"]) / 2 == pytest.approx(1000)
    # One virtual draw: a scores 3.5 of 5, P = 0.7, d = 400 log10(7/3) = 147.19.
    elo = elo_ratings([("a", "b", Record(wins=3, losses=1))])
    assert elo["a"] - elo["b"] == pytest.approx(147.19, abs=0.01)
    # A draw is half a win to each side: 1 win, 2 draws, 1 loss is even.
    even = elo_ratings([("a", "b", Record(wins=1, draws=2, losses=1))], prior_draws=0)
    assert even["a"] == pytest.approx(even["b"])


def test_elo_of_three_consistent_players_is_exact_and_order_free():
    """a-b 3:1, b-c 3:1, a-c 9:1: P(a beats c) = 0.9 = the product of the odds 3 x 3, so the
    maximum likelihood has a 190.85 above b and b 190.85 above c (each player's expected score
    then equals its actual one)."""
    games = [
        ("a", "b", Record(wins=3, losses=1)),
        ("b", "c", Record(wins=3, losses=1)),
        ("c", "a", Record(wins=1, losses=9)),  # the row's point of view: c lost 9 of 10
    ]
    elo = elo_ratings(games, prior_draws=0)
    assert elo["a"] - elo["b"] == pytest.approx(ELO_3_TO_1, abs=1e-6)
    assert elo["b"] - elo["c"] == pytest.approx(ELO_3_TO_1, abs=1e-6)
    assert sum(elo.values()) / 3 == pytest.approx(1000)
    for order in itertools.permutations(games):
        assert elo_ratings(list(order), prior_draws=0) == pytest.approx(elo)


def test_a_perfect_record_needs_the_prior():
    with pytest.raises(ConfigError, match="won or lost every game"):
        elo_ratings([("a", "b", Record(wins=4))], prior_draws=0)
    elo = elo_ratings([("a", "b", Record(wins=4))])  # 4.5 of 5: P = 0.9, d = 400 log10(9)
    assert elo["a"] - elo["b"] == pytest.approx(2 * ELO_3_TO_1, abs=1e-6)
    # A pair whose every episode aborted has no result: neither side is rated from it.
    assert set(elo_ratings([("a", "b", Record(wins=1, losses=1)), ("a", "z", Record(aborted=3))])) == {"a", "b"}


def _episode(seed: int, rewards: dict[str, float], aborted: str | None = None) -> EpisodeResult:
    trajectories = {role: Trajectory(role, (), reward, True, False) for role, reward in rewards.items()}
    return EpisodeResult(f"e{seed}", "prisoners_dilemma-v0", seed, trajectories, 2, 0.0, aborted)


def test_the_outcome_is_the_row_players_in_the_seat_it_played():
    seat: dict[int | None, str] = {10: "player_0", 11: "player_1", 12: "player_0", 13: "player_1"}
    done = [
        _episode(10, {"player_0": 5, "player_1": 0}),  # the row in player_0 won
        _episode(11, {"player_0": 5, "player_1": 0}),  # the row in player_1 lost
        _episode(12, {"player_0": 3, "player_1": 3}),  # a draw
        _episode(13, {"player_0": 0, "player_1": 5}),  # the row in player_1 won
    ]
    assert _record(done, seat, aborted=1) == Record(wins=2, draws=1, losses=1, aborted=1)


def test_the_table_round_trips_through_the_run_directory_and_show_renders_it(tmp_path):
    results = {"me": {"base": Record(3, 1, 0), "me@v2": Record(1, 0, 2, aborted=1)}}
    games = [("me", c, r) for c, r in results["me"].items()]
    table = CrossPlay(4, ("me",), ("base", "me@v2"), results, elo_ratings(games))
    table.save(tmp_path)
    assert CrossPlay.load(tmp_path) == table
    text = table.render()
    assert text.splitlines()[1:3] == ["  agent  base   me@v2", "  me     3-1-0  1-0-2 +1ab"]
    # Best first: me@v2 beat me (2.5 of 4 with the prior draw), who beat base (4 of 5).
    assert [line.split(":")[0].strip() for line in text.splitlines()[-3:]] == ["me@v2", "me", "base"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "wall_s": 1.0}) + "\n")
    assert text in show_run(tmp_path)
    (tmp_path / CROSS_PLAY_FILE).unlink()
    assert CrossPlay.load(tmp_path) is None
    assert "cross-play: none in this run" in show_run(tmp_path)
    (tmp_path / CROSS_PLAY_FILE).write_text('{"rows": 3}')
    with pytest.raises(ConfigError, match="not a cross-play table"):
        CrossPlay.load(tmp_path)


def test_a_league_draws_its_opponents_from_its_pool_and_its_unpinned_frozen_agents():
    agents = [AgentSpec("me"), AgentSpec("base", trainable=False), AgentSpec("old", trainable=False)]
    roles = ["player_0", "player_1"]
    league = PolicyMapping(MappingConfig(kind="league"), roles, agents)  # type: ignore[arg-type]
    assert league.league_opponents() == [Slot(SlotKind.FROZEN, "base"), Slot(SlotKind.FROZEN, "old")]
    league.add_to_pool("me", 3)
    seen = set()
    for seed in range(40):
        slots = league.assign(seed)
        mine = roles[seed % 2]
        assert slots[mine] == Slot(SlotKind.LEARNER, "me")
        seen.add(slots[roles[1 - seed % 2]])
    assert seen == {Slot(SlotKind.PAST, "me", 3), Slot(SlotKind.FROZEN, "base"), Slot(SlotKind.FROZEN, "old")}
    # A frozen agent pinned to a role plays there, and is no league opponent.
    three = ["p0", "p1", "p2"]
    pinned = PolicyMapping(MappingConfig(kind="league", roles={"p2": "old"}), three, agents)  # type: ignore[arg-type]
    assert pinned.league_opponents() == [Slot(SlotKind.FROZEN, "base")]
    assert all(pinned.assign(s)["p2"] == Slot(SlotKind.FROZEN, "old") for s in range(4))
    # Cross-play: the final agent against the frozen ones and the pool's other versions.
    players = Players({a.name: a for a in agents}, {}, {}, current={"me": 5})
    league.add_to_pool("me", 5)  # the final version is in the pool too: the same weights, not a column
    rows, columns = entrants(players, league)
    assert rows == {"me": Slot(SlotKind.LEARNER, "me")}
    assert list(columns) == ["base", "old", "me@v3"] and columns["me@v3"] == Slot(SlotKind.PAST, "me", 3)
