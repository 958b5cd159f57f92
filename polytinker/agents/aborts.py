"""Aborted episodes are never silent: counted in the metrics, shown on the console, and past
``train.max_aborted_share`` the run fails with the first reasons.

An episode aborts when its env raised (the reason names the error and where in the env's code),
its env server died or refused it for too long, or it hit the step limit. An aborted episode
teaches nothing and is left out of the batch and of the evaluation's win rates; when most of a
step's episodes abort, the numbers that remain describe the few that did not, so the run stops
and says why instead of reporting "0.00 -> 0.00".
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from polytinker.envs.types import EpisodeResult
from polytinker.errors import EnvError

log = logging.getLogger("polytinker.agents")


def aborted_metrics(results: Sequence[EpisodeResult], prefix: str = "") -> dict[str, float]:
    """``{prefix}aborted`` (episodes) and ``{prefix}aborted_share`` (of all episodes)."""
    aborted = sum(r.aborted is not None for r in results)
    return {f"{prefix}aborted": float(aborted), f"{prefix}aborted_share": aborted / max(1, len(results))}


def first_reasons(results: Sequence[EpisodeResult], limit: int = 3) -> str:
    """The most common abort reasons, with their counts: ``"RuntimeError: boom (at x.py:3 in f)
    (30 episodes); ..."``."""
    counts = Counter(r.aborted for r in results if r.aborted is not None)
    shown = [f"{reason} ({n} episode{'s' if n != 1 else ''})" for reason, n in counts.most_common(limit)]
    more = len(counts) - len(shown)
    return "; ".join(shown) + (f"; and {more} other reasons" if more > 0 else "")


def check_aborted(results: Sequence[EpisodeResult], max_share: float, what: str) -> None:
    """Warn about aborted episodes; raise ``EnvError`` when more than ``max_share`` of them were."""
    aborted = sum(r.aborted is not None for r in results)
    if not aborted:
        return
    share = aborted / len(results)
    summary = f"{what}: {aborted} of {len(results)} episodes aborted: {first_reasons(results)}"
    if share > max_share:
        raise EnvError(
            f"{summary}. That is more than train.max_aborted_share = {max_share:g} of them, so the run stops: "
            "fix the env (`polytinker env check ID` runs it and shows where it fails) or its server, "
            "or raise train.max_aborted_share"
        )
    log.warning("%s (left out; the run stops past train.max_aborted_share = %g)", summary, max_share)


__all__ = ["aborted_metrics", "check_aborted", "first_reasons"]
