"""An env author's mistakes are reported at the author's code: ``polytinker env check`` prints a
``fix:`` line that fits what failed, and a hook that returns the wrong type is named with the file
and line of the game that defines it. The game is a plugin written as docs/envs.md says (a package
of its own with a ``polytinker.envs`` entry point), each variant with one mistake."""

from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from polytinker.envs import Coordinator, RandomPolicy, check_env, make
from polytinker.envs import _cli as env_cli
from polytinker.envs import registry as env_registry
from polytinker.envs.checker import format_findings
from polytinker.envs.registry import unregister
from polytinker.errors import EnvHookError

GAMES = '''
from typing import Any, ClassVar

from polytinker.envs import RandomPolicy, TextAECEnv


class HighCard(TextAECEnv):
    """docs/envs.md's example, with a payoff table it never fills."""

    metadata: ClassVar[dict[str, Any]] = {"name": "high_card_v0", "render_modes": ["ansi"]}
    scripted: ClassVar[dict] = {"random": RandomPolicy, "heuristic": RandomPolicy}

    def __init__(self, config=None, render_mode=None):
        self.possible_agents = ["player_0"]
        super().__init__(config, render_mode)

    def instructions(self, agent):
        return "You hold a card from 1 to 10. Answer keep or redraw."

    def _new_game(self):
        self.mine = int(self._rng.integers(1, 11))
        self.done = False
        self.payoff = {}

    def _current_agent(self):
        return "player_0"

    def legal_moves(self, agent):
        return () if self.done else ("keep", "redraw")

    def _apply(self, agent, move):
        self.done = True
        return {agent: self.payoff[move]}  # APPLY-RAISES

    def _is_over(self):
        return self.done

    def _render(self, agent):
        return f"Your card: {self.mine}."


class Fixed(HighCard):
    def _apply(self, agent, move):
        self.done = True
        return {agent: 1.0}


class DictRender(Fixed):
    def _render(self, agent):  # RENDER-DEF
        return {"card": self.mine}


class StrangerReward(Fixed):
    def _apply(self, agent, move):  # REWARD-DEF
        self.done = True
        return {"player_9": 1.0}


class NumberMoves(Fixed):
    def legal_moves(self, agent):  # LEGAL-DEF
        return () if self.done else (1, 2)


class Endless(Fixed):
    def legal_moves(self, agent):
        return ("keep", "redraw")

    def _apply(self, agent, move):
        return {agent: 0.0}
'''


def line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A package installed the way pip leaves one (a module and a dist-info with an entry point)."""
    package = tmp_path / "highcard_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "games.py").write_text(textwrap.dedent(GAMES))
    dist = tmp_path / "highcard_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: highcard-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[polytinker.envs]\nhigh_card-v0 = highcard_pkg.games:HighCard\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_registry, "_plugins_loaded", False)  # look for plugins again
    importlib.invalidate_caches()
    yield package / "games.py"
    unregister("high_card-v0")
    sys.modules.pop("highcard_pkg.games", None)
    sys.modules.pop("highcard_pkg", None)


def fix_lines(findings) -> dict[str, str]:
    return {f.check: f.detail.rsplit("fix: ", 1)[-1] for f in findings if f.status == "FAIL"}


def test_an_exception_in_a_hook_gets_a_fix_naming_the_hook_and_its_line(plugin, capsys):
    line = line_of(plugin, "APPLY-RAISES")
    findings = check_env("high_card-v0")  # the entry point, as `polytinker env check high_card-v0`
    fixes = fix_lines(findings)
    assert set(fixes) == {"pettingzoo api test", "seeded random play ends", "deterministic under a seed"}
    for fix in fixes.values():
        assert fix.startswith("_apply() raised KeyError at ") and f"games.py:{line}: fix it there" in fix
        assert "bounded number of steps" not in fix and "self._rng" not in fix  # the checks' own hints
    # The command prints the same, with the author's frame in the traceback.
    assert env_cli._check(argparse.Namespace(target="high_card-v0", seed=0, env_address="")) == 1
    out = capsys.readouterr().out
    assert f'games.py", line {line}, in _apply' in out and "polytinker/envs/base.py" not in out
    assert f"fix: _apply() raised KeyError at {fixes['seeded random play ends'].split(' at ')[1]}" in out


@pytest.mark.parametrize(
    ("game", "marker", "hook", "returned", "expected"),
    [
        ("DictRender", "RENDER-DEF", "_render", "returned {'card': ", "return str"),
        ("StrangerReward", "REWARD-DEF", "_apply", "'player_9' is not an agent of this game", "['player_0']"),
        ("NumberMoves", "LEGAL-DEF", "legal_moves", "returned (1, 2)", "return a tuple of str"),
    ],
)
def test_a_hook_that_returns_the_wrong_type_is_named_with_its_file_and_line(
    plugin, game, marker, hook, returned, expected
):
    where = f"games.py:{line_of(plugin, marker)}"
    env = make(f"highcard_pkg.games:{game}")
    with pytest.raises(EnvHookError) as raised:
        env.reset(seed=0)
        env.observe("player_0")
        env.step("keep")
    error = raised.value
    assert error.hook == f"{game}.{hook}" and error.where.endswith(where)
    message = str(error)
    assert message.startswith(f"{game}.{hook} (") and where in message and returned in message and expected in message
    # An episode it aborts says the same; so does every failed check's fix line, without
    # polytinker's frames (nothing in the game raised).
    [result] = Coordinator().run_sync(lambda: make(f"highcard_pkg.games:{game}"), RandomPolicy(0), [0])
    assert result.aborted is not None and result.aborted.startswith(f"EnvHookError: {game}.{hook} (")
    assert where in result.aborted
    text = format_findings(game, check_env(f"highcard_pkg.games:{game}"))
    assert "FAIL seeded random play ends" in text and f"fix: make {game}.{hook} (" in text
    assert "base.py" not in text and "traceback" not in text and "bounded number of steps" not in text


def test_each_failure_class_gets_its_own_fix(plugin):
    endless = fix_lines(check_env("highcard_pkg.games:Endless"))
    assert endless == {"seeded random play ends": endless["seeded random play ends"]}
    assert "within a bounded number of steps" in endless["seeded random play ends"]
    assert all(f.passed for f in check_env("highcard_pkg.games:Fixed"))  # the mistakes are the variants'


def test_an_exception_from_no_frame_of_the_envs_code_gets_the_outside_fix():
    from polytinker.envs.checker import _OUTSIDE, _failure

    text = _failure(KeyError("a key"), _OUTSIDE)  # never raised: it has no frame of any env's code
    assert text.startswith("KeyError: 'a key'") and text.endswith(f"fix: {_OUTSIDE}")
    assert "raised outside the env's code" in _OUTSIDE and "docs/envs.md" in _OUTSIDE
