"""An env server written with pyzmq and msgpack alone (it does not import polytinker).

It serves one game, ``nim-v0``, by the protocol of docs/remote-envs.md on the envelope of
docs/wire-protocol.md, to show that an env server can be written in any language. Nim: a pile of
stones; players take 1, 2 or 3 in turn; whoever takes the last stone wins (+1, the other -1).

    python examples/remote_env_plain.py --bind tcp://127.0.0.1:5600

and from polytinker::

    from polytinker.envs import RemoteEnv
    env = RemoteEnv("tcp://127.0.0.1:5600", "nim-v0")

It prints ``listening on ADDRESS`` once bound (``--bind tcp://127.0.0.1:0`` picks a free port).
"""

from __future__ import annotations

import argparse
import random
import secrets
import sys
import traceback
import uuid
from typing import Any

import msgpack
import zmq

VERSION = 1
REQUEST, REPLY, ERROR, TELL, PING, PONG, CANCEL = 1, 2, 3, 4, 5, 6, 7
AGENTS = ["player_0", "player_1"]
# The EnvConfig fields this server applies (env.open's "config"), with their defaults. Of the
# others it accepts what it does anyway: only the fallback when retries run out (so
# forfeit_reward never applies), and its own text bounds (announced in the open reply).
CONFIG = {"invalid_action_penalty": -0.1, "max_retries": 2}
AS_IT_DOES = {"on_retries_exhausted", "forfeit_reward", "max_observation_chars", "max_action_chars"}


class ConfigProblem(ValueError):
    """An env.open config this server cannot apply: answered with the error code "config"."""


def game_config(raw: Any) -> dict[str, Any]:
    config = dict(CONFIG)
    for key, value in (raw or {}).items():
        if key in AS_IT_DOES:
            if key == "on_retries_exhausted" and value != "fallback":
                raise ConfigProblem(f"env.open config.on_retries_exhausted: this server only falls back, not {value!r}")
            continue
        if key not in CONFIG:
            raise ConfigProblem(f"env.open config: unknown key {key!r}; this server applies {sorted(CONFIG)}")
        wanted = int if key == "max_retries" else (int, float)
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise ConfigProblem(f"env.open config.{key}: expected a number, got {type(value).__name__} {value!r}")
        config[key] = value
    if config["max_retries"] < 0 or config["invalid_action_penalty"] > 0:
        raise ConfigProblem("env.open config: max_retries must be >= 0 and invalid_action_penalty <= 0")
    return config


class Nim:
    """The game, with the bookkeeping of a PettingZoo AEC env kept in plain dicts."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.penalty, self.max_retries = float(config["invalid_action_penalty"]), int(config["max_retries"])
        self.rng = random.Random()
        self.reset(None)

    def reset(self, seed: int | None) -> None:
        if seed is not None:
            self.rng = random.Random(seed)
        self.stones = self.rng.randint(7, 15)
        self.turn = 0
        self.agents = list(AGENTS)
        self.rewards = dict.fromkeys(AGENTS, 0.0)
        self.cumulative = dict.fromkeys(AGENTS, 0.0)
        self.done = dict.fromkeys(AGENTS, False)
        self.retries = dict.fromkeys(AGENTS, 0)
        self.feedback = dict.fromkeys(AGENTS, "")
        self.selection = AGENTS[0]
        self.winner = ""

    def legal(self, agent: str) -> list[str]:
        if self.done.get(agent, True) or agent != self.selection:
            return []
        return [str(k) for k in (1, 2, 3) if k <= self.stones]

    def parse(self, agent: str, text: str) -> tuple[int | None, str]:
        words = [w.strip(".,!") for w in text.split()]
        numbers = [w for w in words if w in self.legal(agent)]
        if not numbers:
            return None, f"{text.strip()[:40]!r} is not a legal move; answer one of {', '.join(self.legal(agent))}"
        return int(numbers[-1]), ""

    def observe(self, agent: str) -> dict[str, Any]:
        if self.stones == 0:
            status = "You took the last stone: you won." if self.winner == agent else "You lost."
        elif agent == self.selection:
            status = f"Your turn: take {' or '.join(self.legal(agent))} stones."
        else:
            status = "Waiting for the other player."
        text = f"Stones left: {self.stones}.\n{status}"
        if self.feedback[agent]:
            text += "\n" + self.feedback[agent]
        return {"text": text, "legal_moves": self.legal(agent), "current_player": self.selection}

    def step(self, action: str | None) -> None:
        agent = self.selection
        if self.done[agent]:  # the dead step: the agent leaves; the next dead one is selected
            self.agents.remove(agent)
            for d in (self.rewards, self.cumulative, self.done):
                del d[agent]
            self.selection = self.agents[0] if self.agents else ""
            self.rewards = dict.fromkeys(self.agents, 0.0)
            return
        self.cumulative[agent] = 0.0
        self.rewards = dict.fromkeys(self.agents, 0.0)
        take, reason = self.parse(agent, action or "")
        if take is None:
            self.rewards[agent] += self.penalty
            self.retries[agent] += 1
            left = self.max_retries + 1 - self.retries[agent]
            if left > 0:
                self.feedback[agent] = f"Invalid action: {reason}. Try again ({left} tries left)."
                self._accumulate()
                return
            self.feedback[agent] = f"Invalid action: {reason}. No tries left."
            self.retries[agent] = 0
            take = 1  # retries exhausted: the fallback move (the sentence stays until a valid move)
        else:
            self.retries[agent], self.feedback[agent] = 0, ""
        self.stones -= take
        if self.stones == 0:
            self.winner = agent
            for a in self.agents:
                self.rewards[a] += 1.0 if a == agent else -1.0
                self.done[a] = True
        else:
            self.turn += 1
            self.selection = AGENTS[self.turn % 2]
        self._accumulate()

    def _accumulate(self) -> None:
        for a, r in self.rewards.items():
            self.cumulative[a] += r

    def info(self, agent: str) -> dict[str, Any]:
        if not self.feedback[agent]:
            return {"view": {}}
        left = self.max_retries + 1 - self.retries[agent] if self.retries[agent] else 0
        return {"view": {}, "invalid_action": self.feedback[agent], "retries_left": left}

    def state(self) -> dict[str, Any]:
        return {
            "agents": list(self.agents),
            "agent_selection": self.selection,
            "rewards": dict(self.rewards),
            "cumulative_rewards": dict(self.cumulative),
            "terminations": dict(self.done),
            "truncations": dict.fromkeys(self.agents, False),
            "infos": {a: self.info(a) for a in self.agents},
            "observation": self.observe(self.selection) if self.agents else None,
        }


INSTRUCTIONS = (
    "You play nim. There is a pile of stones; players take 1, 2 or 3 stones in turn, and whoever takes the last "
    "stone wins. Answer with the number of stones you take."
)


class Server:
    def __init__(self) -> None:
        self.episodes: dict[str, Nim] = {}

    def handle(self, kind: str, req: Any) -> Any:
        if kind == "env.list":
            return {"env_ids": ["nim-v0"]}
        if not isinstance(req, dict):
            raise ValueError("the payload must be a map")
        if kind == "env.open":
            if req.get("env_id") != "nim-v0":
                raise LookupError(f"this server serves only nim-v0, not {req.get('env_id')!r}")
            episode = uuid.uuid4().hex
            self.episodes[episode] = Nim(game_config(req.get("config")))
            return {
                "episode": episode,
                "env_id": "nim-v0",
                "kind": "aec",
                "name": "nim_v0",
                "possible_agents": AGENTS,
                "instructions": dict.fromkeys(AGENTS, INSTRUCTIONS),
                "max_observation_chars": 4096,
                "max_action_chars": 512,
                "scripted": [],  # no env.scripted here: a client plays "random" from the legal moves
            }
        game = self.episodes.get(req.get("episode", ""))
        if game is None:
            raise LookupError(f"no open episode {req.get('episode')!r}")
        if kind == "env.reset":
            game.reset(req.get("seed"))
            return game.state()
        if kind == "env.step":
            game.step(req.get("action"))
            return game.state()
        if kind == "env.observe":
            return game.observe(req["agent"])
        if kind == "env.parse":
            take, reason = game.parse(req["agent"], req["text"])
            return {"valid": take is not None, "move": "" if take is None else str(take), "reason": reason}
        if kind == "env.close":
            return {"closed": self.episodes.pop(req["episode"], None) is not None}
        raise KeyError(f"unknown kind {kind!r}")


def error_body(code: str, exc: BaseException) -> bytes:
    """The caller gets the error's type, message and an id; the traceback stays in this log."""
    error_id = secrets.token_hex(6)
    print(f"error {error_id}: {traceback.format_exc()}", file=sys.stderr, flush=True)
    return msgpack.packb(
        {"code": code, "type": type(exc).__name__, "message": str(exc)[:2000], "error_id": error_id, "traceback": ""}
    )


def serve(bind: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(bind.replace(":0", ":*") if bind.endswith(":0") else bind)
    print(f"listening on {sock.last_endpoint.decode()}", flush=True)
    server = Server()
    while True:
        ident, *frames = sock.recv_multipart()
        try:
            version, mtype, rid, kind = msgpack.unpackb(frames[0])
            if version != VERSION:
                raise ValueError(f"protocol version {version} is not spoken here (this server speaks {VERSION})")
        except Exception as exc:
            sock.send_multipart([ident, msgpack.packb([VERSION, ERROR, 0, ""]), error_body("malformed", exc)])
            continue
        if mtype == PING:
            sock.send_multipart([ident, msgpack.packb([VERSION, PONG, 0, ""])])
            continue
        if mtype not in (REQUEST, TELL):
            continue
        try:
            payload = msgpack.unpackb(frames[1]) if len(frames) > 1 else None
            result = server.handle(kind, payload)
            reply = [msgpack.packb([VERSION, REPLY, rid, kind]), msgpack.packb(result)]
        except Exception as exc:
            code = "config" if isinstance(exc, ConfigProblem) else "handler"
            reply = [msgpack.packb([VERSION, ERROR, rid, kind]), error_body(code, exc)]
        if mtype == REQUEST:
            sock.send_multipart([ident, *reply])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="tcp://127.0.0.1:5600")
    serve(parser.parse_args().bind)
