"""Aborted episodes are never silent: counted in the metrics, shown on the console, and past
``train.max_aborted_share`` the run fails with the first reasons.

An episode aborts when its env raised (the reason names the error and where in the env's code),
its env server died or refused it for too long, or it hit the step limit. An aborted episode
teaches nothing and is left out of the batch and of the evaluation's win rates; when most of a
step's episodes abort, the numbers that remain describe the few that did not, so the run stops
and says why instead of reporting "0.00 -> 0.00".

Reasons are grouped as they read with the episode id taken out: a remote env's errors name their
episode ("env.step of ID episode 3fa2... at ADDRESS"), and 32 episodes that failed the same way
are one reason with its count, shown with one of their ids (the server's log names each).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from polytinker.agents.config import EnvSetup
from polytinker.envs.types import EpisodeResult
from polytinker.errors import EnvError

log = logging.getLogger("polytinker.agents")


def aborted_metrics(results: Sequence[EpisodeResult], prefix: str = "") -> dict[str, float]:
    """``{prefix}aborted`` (episodes) and ``{prefix}aborted_share`` (of all episodes)."""
    aborted = sum(r.aborted is not None for r in results)
    return {f"{prefix}aborted": float(aborted), f"{prefix}aborted_share": aborted / max(1, len(results))}


# An episode id in a reason (the coordinator's 12 hex digits, an env server's 32).
_EPISODE_ID = re.compile(r"\bepisode [0-9a-f]{12,32}\b")


def first_reasons(results: Sequence[EpisodeResult], limit: int = 3) -> str:
    """The most common abort reasons, with their counts: ``"RuntimeError: boom (at x.py:3 in f)
    (30 episodes); ..."``. Reasons that differ only in the episode they name are one reason, shown
    with the first one's id."""
    groups: dict[str, list[str]] = {}  # the reason without its episode ids -> the reasons as written
    for r in results:
        if r.aborted is not None:
            groups.setdefault(_EPISODE_ID.sub("episode <id>", r.aborted), []).append(r.aborted)
    ranked = sorted(groups.values(), key=len, reverse=True)  # stable: the first seen first among ties
    shown = [_counted(group) for group in ranked[:limit]]
    more = len(ranked) - len(shown)
    return "; ".join(shown) + (f"; and {more} other reason{'s' if more != 1 else ''}" if more > 0 else "")


def _counted(group: list[str]) -> str:
    n = len(group)
    ids = ", each with its own episode id: one shown" if n > 1 and len(set(group)) > 1 else ""
    return f"{group[0]} ({n} episode{'s' if n != 1 else ''}{ids})"


def _fix(env: EnvSetup | None) -> str:
    """How to find the fault: the checker on the env as the run plays it (a served env through its
    server, so the command names the address)."""
    if env is None:
        return "fix the env (`polytinker env check ID` runs it and shows where it fails) or its server"
    if env.address:
        return (
            f"fix the env (`polytinker env check {env.id} --env-address {env.address}` runs the served env and "
            f"shows where it fails) or its server (is it up at {env.address} and serving {env.id}? "
            "its log names each aborted episode)"
        )
    return f"fix the env (`polytinker env check {env.id}` runs it and shows where it fails)"


def check_aborted(
    results: Sequence[EpisodeResult], max_share: float, what: str, *, env: EnvSetup | None = None
) -> None:
    """Warn about aborted episodes; raise ``EnvError`` when more than ``max_share`` of them were.
    ``env``: the run's env, named in the fix (with its server's address for a remote env)."""
    aborted = sum(r.aborted is not None for r in results)
    if not aborted:
        return
    share = aborted / len(results)
    summary = f"{what}: {aborted} of {len(results)} episodes aborted: {first_reasons(results)}"
    if share > max_share:
        raise EnvError(
            f"{summary}. That is more than train.max_aborted_share = {max_share:g} of them, so the run stops: "
            f"{_fix(env)}, or raise train.max_aborted_share"
        )
    log.warning("%s (left out; the run stops past train.max_aborted_share = %g)", summary, max_share)


__all__ = ["aborted_metrics", "check_aborted", "first_reasons"]
