"""Cross-play: the final agents against the frozen opponents and each other, and an Elo per player.

After training (``eval.cross_play_episodes > 0``), each trainable agent at its final version (a
row) plays each opponent (a column): every frozen agent (``trainable = false``), every past
version in a league's pool (``agent@vN``; the one equal to the final version is left out: it is
the same weights), and, when two or more agents train, every other trainable agent. A pair plays
``episodes`` episodes on the seeds ``eval.seed + i``, the row agent in role ``i mod roles`` (so it
plays every seat) and the opponent in every other role, sampled at ``eval_temperature`` with the
evaluation's per-decision seeds (``Players.policy``): a pair's episodes repeat, and every pair
plays the same deals.

Outcomes are the row's: a win is more reward than every other role, a loss is another role with
more reward than the row's, anything else a draw; an aborted episode is counted apart, so
``wins + draws + losses + aborted == episodes`` in every cell.

``elo_ratings`` fits one rating per player to those results: the Bradley-Terry maximum
likelihood (Hunter's MM iteration) on the Elo scale, P(i beats j) = 1 / (1 + 10^((r_j - r_i) / 400)),
a draw half a win to each side, with ``prior_draws`` virtual draws added to every pair that met,
so a player who won (or lost) every game gets a finite rating, as BayesElo's prior does; the
ratings' mean is 1000. Unlike Elo updates iterated over the games, the fit does not depend on
the order they were played in.

The table goes to the run directory as ``crossplay.json``; ``CrossPlay.load(run_dir).render()``
is what ``examples/league.py`` and ``polytinker show RUN`` print.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polytinker.agents.aborts import check_aborted
from polytinker.agents.mapping import PolicyMapping
from polytinker.agents.metrics import transcript
from polytinker.agents.rollout import Players
from polytinker.agents.types import Slot, SlotKind
from polytinker.envs import Coordinator
from polytinker.envs.coordinator import EnvFactory
from polytinker.envs.types import EpisodeResult
from polytinker.errors import ConfigError

CROSS_PLAY_FILE = "crossplay.json"
ELO_MEAN = 1000.0


@dataclass(frozen=True)
class Record:
    """The row player's results against one opponent."""

    wins: int = 0
    draws: int = 0
    losses: int = 0
    aborted: int = 0  # episodes the env broke: no outcome

    @property
    def games(self) -> int:
        return self.wins + self.draws + self.losses

    def cell(self) -> str:
        text = f"{self.wins}-{self.draws}-{self.losses}"
        return text + (f" +{self.aborted}ab" if self.aborted else "")


@dataclass(frozen=True)
class CrossPlay:
    """The cross-play table of one run: rows (final agents) x columns (opponents), and Elo."""

    episodes: int  # per pair
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    results: dict[str, dict[str, Record]]  # row -> column -> record
    elo: dict[str, float]  # every row and column

    def render(self) -> str:
        """The table (wins-draws-losses of the row player) and each player's Elo, best first."""
        head = ["agent", *self.columns]
        body = [[row, *(self.results[row][c].cell() if c != row else "-" for c in self.columns)] for row in self.rows]
        widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
        lines = [f"cross-play: {self.episodes} episodes a pair, wins-draws-losses of the row agent (seats alternate)"]
        for line in [head, *body]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
        lines.append(f"Elo (Bradley-Terry fit, mean {ELO_MEAN:.0f}):")
        lines += [f"  {name}: {rating:.0f}" for name, rating in sorted(self.elo.items(), key=lambda kv: -kv[1])]
        return "\n".join(lines)

    def save(self, run_dir: Path) -> None:
        (run_dir / CROSS_PLAY_FILE).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, run_dir: str | Path) -> CrossPlay | None:
        """The run's table, or None when the run has none."""
        path = Path(run_dir) / CROSS_PLAY_FILE
        if not path.exists():
            return None
        try:
            raw = json.loads(path.read_text())
            results = {r: {c: Record(**rec) for c, rec in cols.items()} for r, cols in raw["results"].items()}
            return cls(raw["episodes"], tuple(raw["rows"]), tuple(raw["columns"]), results, raw["elo"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{path} is not a cross-play table ({type(exc).__name__}: {exc})") from None


def entrants(players: Players, mapping: PolicyMapping) -> tuple[dict[str, Slot], dict[str, Slot]]:
    """(rows, columns), each a label -> slot: the trainable agents at their final versions; the
    frozen agents, the league pool's past versions and, with two or more, the trainable agents."""
    rows = {name: Slot(SlotKind.LEARNER, name) for name, spec in mapping.specs.items() if spec.trainable}
    columns = {name: Slot(SlotKind.FROZEN, name) for name, spec in mapping.specs.items() if not spec.trainable}
    for agent, versions in mapping.pool.items():
        for version in versions:
            if version != players.current.get(agent):
                columns[f"{agent}@v{version}"] = Slot(SlotKind.PAST, agent, version)
    if len(rows) > 1:  # the final agents against each other too (the diagonal is not played)
        columns.update(rows)
    return rows, columns


async def cross_play(
    players: Players,
    mapping: PolicyMapping,
    make_env: EnvFactory,
    coordinator: Coordinator,
    *,
    episodes: int,
    seed: int,
    step: int,
    max_aborted_share: float = 1.0,
) -> tuple[CrossPlay, list[dict[str, Any]]]:
    """Play every row against every other column; the table and one transcript per pair."""
    roles = mapping.env_roles
    if len(roles) < 2:
        raise ConfigError(f"cross-play needs an env with two or more roles; this one has {roles}")
    rows, columns = entrants(players, mapping)
    seeds = [seed + i for i in range(episodes)]
    pairs = [(r, c) for r in rows for c in columns if r != c]

    async def play(row: str, column: str) -> list[EpisodeResult]:
        slots = {
            s: {role: rows[row] if role == roles[i % len(roles)] else columns[column] for role in roles}
            for i, s in enumerate(seeds)
        }
        policy = players.policy(slots, evaluation=True, sample_seed=seed)
        return await coordinator.run(make_env, policy, seeds)

    outcomes = await asyncio.gather(*(play(r, c) for r, c in pairs))
    check_aborted([e for results in outcomes for e in results], max_aborted_share, "cross-play")
    results: dict[str, dict[str, Record]] = {r: {} for r in rows}
    transcripts = []
    seat: dict[int | None, str] = {s: roles[i % len(roles)] for i, s in enumerate(seeds)}  # the row's role
    for (row, column), played in zip(pairs, outcomes, strict=True):
        done = [e for e in played if e.aborted is None and e.seed in seat]
        results[row][column] = _record(done, seat, aborted=len(played) - len(done))
        if done:
            mine = seat[done[0].seed]
            who = {role: row if role == mine else column for role in roles}
            transcripts.append(transcript(done[0], step, "crossplay", who))
    games = [(r, c, rec) for r, cols in results.items() for c, rec in cols.items()]
    table = CrossPlay(episodes, tuple(rows), tuple(columns), results, elo_ratings(games))
    return table, transcripts


def _record(done: Sequence[EpisodeResult], seat: dict[int | None, str], *, aborted: int) -> Record:
    """The row player's outcomes in the episodes that ended; it played ``seat[seed]``."""
    wins = draws = losses = 0
    for episode in done:
        mine = seat[episode.seed]
        totals = episode.total_rewards
        best_other = max(v for role, v in totals.items() if role != mine)
        if totals[mine] > best_other:
            wins += 1
        elif totals[mine] < best_other:
            losses += 1
        else:
            draws += 1
    return Record(wins, draws, losses, aborted)


def elo_ratings(
    games: Sequence[tuple[str, str, Record]], *, prior_draws: float = 1.0, tolerance: float = 1e-10
) -> dict[str, float]:
    """Elo ratings (mean ``ELO_MEAN``) of every player with a game in ``games`` ((a, b, a's
    record against b)): the Bradley-Terry maximum likelihood, found with Hunter's MM updates
    ``gamma_i = W_i / sum_j n_ij / (gamma_i + gamma_j)``, with ``prior_draws`` virtual draws per pair
    that met. ``prior_draws = 0`` is the plain MLE, which is infinite for a perfect record."""
    names = sorted({p for a, b, record in games if record.games for p in (a, b)})
    index = {name: i for i, name in enumerate(names)}
    n = len(names)
    score_NN = np.zeros((n, n))  # score_NN[i, j]: i's wins against j, a draw counting one half
    played_NN = np.zeros((n, n))
    for a, b, record in games:
        if not record.games:  # every episode aborted: no result
            continue
        i, j = index[a], index[b]
        score_NN[i, j] += record.wins + record.draws / 2
        score_NN[j, i] += record.losses + record.draws / 2
        played_NN[i, j] += record.games
        played_NN[j, i] += record.games
    met_NN = played_NN > 0
    score_NN += met_NN * (prior_draws / 2)
    played_NN += met_NN * prior_draws
    wins_N = score_NN.sum(axis=1)
    perfect = [names[i] for i in range(n) if wins_N[i] <= 0 or wins_N[i] >= played_NN[i].sum()]
    if perfect:
        raise ConfigError(f"no finite Elo for {perfect} (won or lost every game): use prior_draws > 0")
    gamma_N = np.ones(n)
    for _ in range(100_000):
        updated_N = wins_N / (played_NN / (gamma_N[:, None] + gamma_N[None, :])).sum(axis=1)
        updated_N /= np.exp(np.log(updated_N).mean())  # the scale is free: geometric mean 1
        converged = np.abs(np.log(updated_N) - np.log(gamma_N)).max() < tolerance
        gamma_N = updated_N
        if converged:
            break
    ratings_N = ELO_MEAN + 400.0 * np.log10(gamma_N)
    return {name: float(ratings_N[index[name]]) for name in names}


__all__ = ["CROSS_PLAY_FILE", "CrossPlay", "Record", "cross_play", "elo_ratings", "entrants"]
