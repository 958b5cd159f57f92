"""Conformance checks for text envs (``polytinker env check``).

``check_env("tictactoe-v0")`` (or ``"mypkg.games:MyGame"``, or a zero-argument factory) runs
PettingZoo's own API test (``api_test`` or ``parallel_api_test``) and polytinker's checks: text
observations inside the observation space, instructions for every agent, every listed legal
move parsed back as legal, an empty action refused, episodes that end under seeded random play,
the same transcript twice under the same seed, scripted opponents present. Each failure says
how to fix it: the env's traceback (from the first frame of the env's own code) and a hint that
fits the error. A check that could not run (the env could not be built, random play aborted
before it got there) is reported as not run, never as passed. ``address=`` checks an env served
by an env server (``polytinker env check --env-address``).
"""

from __future__ import annotations

import contextlib
import io
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pettingzoo import AECEnv
from pettingzoo.test import api_test, parallel_api_test

from polytinker.envs._trace import env_hook, env_location, env_traceback
from polytinker.envs.config import CoordinatorConfig
from polytinker.envs.coordinator import Coordinator
from polytinker.envs.opponents import ScriptedPolicy, scripted_policy
from polytinker.envs.source import EnvSource
from polytinker.envs.types import AgentID, EpisodeResult, InvalidAction, PolicyInput
from polytinker.errors import EnvHookError, PolytinkerError, RequestTimeout, TransportError


@dataclass(frozen=True)
class Finding:
    """The outcome of one check."""

    check: str
    passed: bool
    # What went wrong and how to fix it ("" when passed).
    detail: str = ""
    # False: the check could not run (an earlier failure stopped it); it is not passed either.
    ran: bool = True

    @property
    def status(self) -> Literal["ok", "FAIL", "SKIP"]:
        return "ok" if self.passed else ("FAIL" if self.ran else "SKIP")


class _NotRun(Exception):
    """A check that could not run; the message says why."""


class _Envs:
    """The checks' env factory: it remembers what it made, so that every env (every remote
    episode) is closed at the end, whoever made it."""

    def __init__(self, make_env: Callable[[], Any]) -> None:
        self._make = make_env
        self.made: list[Any] = []

    def __call__(self) -> Any:
        env = self._make()
        self.made.append(env)
        return env

    def close(self) -> None:
        for env in self.made:
            with contextlib.suppress(Exception):  # closing twice, or a server already gone
                env.close()
        self.made.clear()


def _factory(target: str | Callable[[], Any], address: str) -> Callable[[], Any]:
    if callable(target):
        return target
    return EnvSource(target, address=address).make


def _run(check: str, fn: Callable[[], str], fix: str) -> Finding:
    try:
        problem = fn()
    except _NotRun as why:
        return Finding(check, False, f"not run: {why}", ran=False)
    except Exception as exc:
        # A PettingZoo assertion is the check's own finding (its fix says which contract); any
        # other exception gets the fix of what raised it, never the check's.
        return Finding(check, False, _failure(exc, fix if isinstance(exc, AssertionError) else _OUTSIDE))
    if not problem:
        return Finding(check, True)
    return Finding(check, False, f"{problem}\n    fix: {fix}")


def _failure(exc: BaseException, fallback: str) -> str:
    """The error, the env's traceback and a hint that fits it (``fallback`` when nothing does)."""
    head = f"{exc or 'assertion failed'}" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
    trace = env_traceback(exc, indent="      ")
    lines = [head, f"    traceback (the env's code):\n{trace}" if trace else ""]
    lines.append(f"    fix: {_hint(exc) or fallback}")
    return "\n".join(line for line in lines if line)


# An exception with no frame of the env's code and no word of polytinker's about it.
_OUTSIDE = (
    "this was raised outside the env's code (in polytinker or PettingZoo, driving the env): compare what "
    "the env's hooks return with the contract in docs/envs.md; if they keep it, report this traceback"
)


def _hint(exc: BaseException) -> str:
    """The fix line for an exception, by what raised it and where ("" when nothing fits)."""
    if isinstance(exc, EnvHookError):
        return f"make {exc.hook} ({exc.where or 'the env class'}) return {exc.expected}"
    if isinstance(exc, NotImplementedError) and not isinstance(exc, PolytinkerError):
        frames = traceback.extract_tb(exc.__traceback__)
        hook = frames[-1].name if frames else "a hook"
        return (
            f"implement {hook}() in the env class: it is a hook of TextAECEnv/TextParallelEnv that the "
            "game must write (docs/envs.md, Writing a game)"
        )
    where = env_location(exc)
    if where:
        hook, raised = env_hook(exc), type(exc).__name__
        at = where.removesuffix(f" in {hook}")  # the hook itself raised: its name once is enough
        return f"{hook}() raised {raised} at {at}: fix it there (the traceback above ends at that line)"
    if isinstance(exc, TransportError | RequestTimeout):
        return "the env server did not answer: check that it runs at that address and serves this env id"
    if isinstance(exc, PolytinkerError):
        return "fix what the message names (a served env raised on its server: the server's log has the traceback)"
    return ""


_FIXES = {
    "pettingzoo api test": "see PettingZoo's AECEnv/ParallelEnv contract; the message names the rule",
    "instructions": "define instructions(agent) -> str with the rules and the answer format for each agent",
    "text observations": "observe(agent) must return {'text': str, 'legal_moves': tuple[str, ...], "
    "'current_player': str} inside observation_space(agent)",
    "seeded random play ends": "the game must end (terminate or truncate every agent) within a bounded number of steps",
    "legal moves parse back": "parse_action(agent, move) must accept every string that legal_moves(agent) lists",
    "empty action refused": "parse_action(agent, '') must return InvalidAction",
    "deterministic under a seed": "draw every random choice from the generator seeded in reset(seed) "
    "(self._rng), never from global random state",
    "scripted opponents": "set the class attribute scripted = {'random': ..., 'heuristic': ...} "
    "with ScriptedPolicy subclasses",
}


def check_env(
    target: str | Callable[[], Any], *, seed: int = 0, max_steps: int = 2000, address: str = ""
) -> list[Finding]:
    """Run every check; when the env cannot be built, the others are reported as not run.
    ``target``: a registered id, ``"package.module:Class"`` or a zero-argument factory; with
    ``address``, an id served by the env server there."""
    make_env = _Envs(_factory(target, address))
    try:
        return _checks(make_env, seed, max_steps)
    finally:
        make_env.close()


def _checks(make_env: _Envs, seed: int, max_steps: int) -> list[Finding]:
    try:
        probe = make_env()
    except Exception as exc:
        fix = "the entry point must build an env with no arguments: give every parameter a default"
        failed = Finding("construct", False, _failure(exc, fix))
        return [failed] + [Finding(name, False, "not run: the env could not be built", ran=False) for name in _FIXES]
    roundtrip: list[str] = []  # filled by the random play, reported by the check after it
    played: list[EpisodeResult] = []
    checks: list[tuple[str, Callable[[], str]]] = [
        ("pettingzoo api test", lambda: _pettingzoo(make_env)),
        ("instructions", lambda: _instructions(probe)),
        ("text observations", lambda: _text_observations(make_env, seed)),
        ("seeded random play ends", lambda: _play(make_env, seed, max_steps, roundtrip, played)),
        ("legal moves parse back", lambda: _parsed_back(roundtrip, played)),
        ("empty action refused", lambda: _empty_refused(make_env, seed)),
        ("deterministic under a seed", lambda: _determinism(make_env, seed, max_steps)),
        ("scripted opponents", lambda: _scripted(probe)),
    ]
    findings = [Finding("construct", True)] + [_run(name, fn, _FIXES[name]) for name, fn in checks]
    note = _heuristic_note(probe)
    return [*findings, note] if note else findings


def _pettingzoo(make_env: Callable[[], Any]) -> str:
    env = make_env()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if isinstance(env, AECEnv):
            api_test(env, num_cycles=200)
        else:
            parallel_api_test(env, num_cycles=200)
    return ""


def _instructions(env: Any) -> str:
    missing = []
    for agent in env.possible_agents:
        text = env.instructions(agent) if hasattr(env, "instructions") else None
        if not isinstance(text, str) or not text.strip():
            missing.append(agent)
    return f"no instructions for {', '.join(missing)}" if missing else ""


def _text_observations(make_env: Callable[[], Any], seed: int) -> str:
    env = make_env()
    if isinstance(env, AECEnv):
        env.reset(seed=seed)
        observations = {a: env.observe(a) for a in env.agents}
    else:
        observations, _ = env.reset(seed=seed)
    for agent, obs in observations.items():
        if not isinstance(obs, dict) or not isinstance(obs.get("text"), str) or not obs["text"].strip():
            return f"the observation of {agent} is not a dict with a non-empty 'text': {obs!r:.120}"
        if not env.observation_space(agent).contains(obs):
            return f"the observation of {agent} is outside observation_space({agent!r}): {obs!r:.200}"
    return ""


def _policy_for(env_box: list[Any], roundtrip: list[str], seed: int) -> Callable[[AgentID, PolicyInput], str]:
    """Random play that also checks, at each decision, that the listed legal moves parse back."""
    scripted: dict[AgentID, ScriptedPolicy] = {}

    def policy(agent: AgentID, inp: PolicyInput) -> str:
        env = env_box[-1]
        for move in inp.observation.legal_moves:
            if isinstance(env.parse_action(agent, move), InvalidAction):
                roundtrip.append(f"{agent}: legal move {move!r} is refused by parse_action")
        if agent not in scripted:
            scripted[agent] = scripted_policy(env, "random", seed + len(scripted))
        try:
            return scripted[agent](agent, inp)
        except Exception:
            legal = inp.observation.legal_moves
            return legal[0] if legal else "pass"

    return policy


def _episodes(
    make_env: Callable[[], Any], seed: int, max_steps: int, roundtrip: list[str], n: int
) -> list[EpisodeResult]:
    """``n`` episodes of seeded random play; the first one an env failure aborted re-raises the
    env's exception (with its traceback), so that the check shows where the env broke."""
    box: list[Any] = []

    def factory() -> Any:
        box.append(make_env())
        return box[-1]

    coordinator = Coordinator(CoordinatorConfig(max_concurrent_episodes=1, max_steps_per_episode=max_steps))
    results = []
    for _ in range(n):
        result = coordinator.run_sync(factory, _policy_for(box, roundtrip, seed), [seed])[0]
        if result.aborted and coordinator.last_failure is not None:
            raise coordinator.last_failure
        results.append(result)
    return results


def _play(
    make_env: Callable[[], Any], seed: int, max_steps: int, roundtrip: list[str], played: list[EpisodeResult]
) -> str:
    result = _episodes(make_env, seed, max_steps, roundtrip, 1)[0]
    played.append(result)
    return f"episode aborted: {result.aborted}" if result.aborted else ""


def _parsed_back(roundtrip: list[str], played: list[EpisodeResult]) -> str:
    if roundtrip:
        return "; ".join(roundtrip[:3])
    if not played or played[0].aborted:
        raise _NotRun("the seeded random play did not finish, so not every listed move was tried")
    return ""


def _empty_refused(make_env: Callable[[], Any], seed: int) -> str:
    env = make_env()
    env.reset(seed=seed)
    agent = env.agent_selection if isinstance(env, AECEnv) else env.agents[0]
    return "" if isinstance(env.parse_action(agent, ""), InvalidAction) else "parse_action accepted an empty action"


def _transcript(result: EpisodeResult) -> list[tuple[Any, ...]]:
    return [
        (agent, turn.observation.text, turn.action, turn.reward)
        for agent, traj in sorted(result.trajectories.items())
        for turn in traj.turns
    ]


def _determinism(make_env: Callable[[], Any], seed: int, max_steps: int) -> str:
    first, second = _episodes(make_env, seed, max_steps, [], 2)
    if first.aborted or second.aborted:
        raise _NotRun(f"the seeded episodes did not finish ({first.aborted or second.aborted})")
    a, b = _transcript(first), _transcript(second)
    if a == b:
        return ""
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"two episodes with seed {seed} and the same moves differ at turn {at}"


def _scripted(env: Any) -> str:
    table = getattr(env, "scripted", None) or {}
    return "" if "random" in table else "no scripted random policy"


def _heuristic_note(env: Any) -> Finding | None:
    if "heuristic" in (getattr(env, "scripted", None) or {}):
        return None
    return Finding(
        "heuristic opponent",
        True,
        "warning: no scripted 'heuristic' policy, so evaluation "
        "against one (and `polytinker env play --opponent heuristic`) falls back to random",
    )


def format_findings(target: str, findings: list[Finding]) -> str:
    lines = [f"{f.status:<4} {f.check}" + (f": {f.detail}" if f.detail else "") for f in findings]
    failed = sum(f.status == "FAIL" for f in findings)
    skipped = sum(f.status == "SKIP" for f in findings)
    summary = f"{target}: {len(findings) - failed - skipped} passed, {failed} failed"
    lines.append(summary + (f", {skipped} not run" if skipped else ""))
    return "\n".join(lines)


__all__ = ["Finding", "check_env", "format_findings"]
