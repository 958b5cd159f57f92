"""The training loop end to end on the tiny-random model, against one local runtime shared by the
tests of this module. They test the loop, not the processes: the runtime is the in-process one
(``ServiceClient(inproc=True)``: the same scheduler, engine and learner, no sockets), whose results
match the process runtime's (tests/test_client_inproc.py); tests/test_client_runtime.py drives the
processes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from fixtures.client import inproc_tiny_client

from polytinker import cli
from polytinker.agents import (
    AdapterSpec,
    AgentSpec,
    AlgorithmConfig,
    CrossPlay,
    EnvSetup,
    EvalConfig,
    Experiment,
    ExperimentConfig,
    MappingConfig,
    OutputConfig,
    RuntimeSetup,
    SamplingConfig,
    TrainConfig,
    train_sft,
)
from polytinker.agents.checkpoint import RunState
from polytinker.agents.metrics import read_metrics
from polytinker.errors import ConfigError

TINY = "tiny-random"

# Training loops on a busy 2-core machine take minutes.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def service():
    client = inproc_tiny_client()
    yield client
    client.close()


def agent(name: str, algorithm: str = "grpo", **kw) -> AgentSpec:
    return AgentSpec(
        name,
        base_model=TINY,
        adapter=AdapterSpec(rank=4, alpha=8),
        algorithm=AlgorithmConfig(name=algorithm, learning_rate=1e-3, **kw),  # type: ignore[arg-type]
        sampling=SamplingConfig(max_tokens=4),
    )


def pd_config(root: Path, name: str = "pd", steps: int = 2, **train) -> ExperimentConfig:
    return ExperimentConfig(
        name=name,
        env=EnvSetup("prisoners_dilemma-v0", {"rounds": 2}),
        # REINFORCE and PPO centre on batch means; the random model's answers are invalid, so the
        # env's seeded fallback moves decide the rewards, which differ across these four seeds.
        agents=(agent("alice", "reinforce"), agent("bob", "ppo", epochs=2, minibatches=2)),
        # Minibatches reach the learner in calls of at most 3 datums (their gradients add up).
        train=TrainConfig(steps=steps, groups=4, group_size=1, max_datums_per_call=3, **train),
        eval=EvalConfig(episodes=2, opponents=("random", "heuristic", "team")),
        output=OutputConfig(root=str(root), checkpoint_every=1, progress=False, tensorboard=True),
    )


def test_two_agents_train_evaluate_and_write_the_run(service, tmp_path, capsys):
    experiment = Experiment(pd_config(tmp_path))
    summary = experiment.train(service=service)
    assert experiment._trainer is not None  # only the current versions' samplers are kept
    players = experiment._trainer.players
    assert set(players.samplers) == {(a, players.current[a]) for a in ("alice", "bob")}
    # The run's jobs ended with it: on a shared runtime they would otherwise hold the learner.
    jobs = [service.get_job(c.job_id)["job"] for c in experiment._trainer.learners.clients.values()]
    assert [j["state"] for j in jobs] == ["done", "done"]
    run = tmp_path / "pd"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]  # eval before, two steps, eval after
    for name in ("alice", "bob"):
        assert rows[1][f"train/datums/{name}"] > 0
        assert rows[2][f"version/{name}"] > rows[1][f"version/{name}"] > 0  # one adapter each, stepping
        assert f"eval/{name}/heuristic/win_rate" in rows[-1] and f"eval/{name}/random/win_rate" in rows[0]
        assert f"eval/{name}/team/reward" in rows[0] and f"eval/{name}/team/reward" in rows[-1]  # the two together
    assert rows[1]["version/bob"] == 4  # ppo: 2 epochs x 2 minibatches = 4 optimizer steps
    assert set(summary.before) <= set(rows[0]) and summary.after["eval/alice/random/reward"] == pytest.approx(
        rows[-1]["eval/alice/random/reward"]
    )
    episodes = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert {"player_0": "alice", "player_1": "bob"} in [e["players"] for e in episodes if e["kind"] == "eval"]
    train = [e for e in episodes if e["kind"] == "train"]
    assert train and train[0]["players"] == {"player_0": "alice", "player_1": "bob"}
    assert len(train[0]["turns"]["player_0"]) >= 2  # two rounds, retries included
    assert (run / "curves.png").stat().st_size > 1000 and list((run / "tb").iterdir())
    assert RunState.load(run).step == 2
    assert cli.main(["show", str(run), "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert "alice vs random: win rate" in shown and "player_0 says:" in shown


def test_resume_continues_from_the_last_checkpoint(service, tmp_path):
    Experiment(pd_config(tmp_path, "r", steps=1)).train(service=service)
    state = RunState.load(tmp_path / "r")
    with pytest.raises(Exception, match="--resume"):
        Experiment(pd_config(tmp_path, "r", steps=2)).train(service=service)
    Experiment(pd_config(tmp_path, "r", steps=2)).train(service=service, resume=True)
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [0, 1, 1, 2, 2]  # the first run's rows, then step 2 only
    assert rows[3]["version/alice"] == state.versions["alice"] + 1  # continued from the checkpoint
    assert RunState.load(tmp_path / "r").step == 2


def test_async_league_self_play(service, tmp_path):
    """Five steps, a version joining the pool after each: the runtime keeps two per-step versions
    (keep_checkpoints), so the pool's older ones are sampled after their step files would have
    been pruned; the named save that put them in the pool keeps them sampleable."""
    config = ExperimentConfig(
        name="league",
        env=EnvSetup("kuhn_poker-v0"),
        agents=(agent("me", "reinforce"),),
        mapping=MappingConfig(kind="league", pool_every=1),  # type: ignore[arg-type]
        train=TrainConfig(steps=5, groups=4, group_size=1, mode="async", max_staleness=1),  # type: ignore[arg-type]
        eval=EvalConfig(episodes=2, at_start=False),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    experiment = Experiment(config)
    experiment.train(service=service)
    state = RunState.load(tmp_path / "league")
    assert state.pool["me"] and all(f"me@{v}" in state.pool_paths for v in state.pool["me"])
    assert experiment._trainer is not None  # the pool's samplers stay, with the current one
    kept = {v for a, v in experiment._trainer.players.samplers if a == "me"}
    assert kept == {*state.pool["me"], experiment._trainer.players.current["me"]}
    episodes = [json.loads(line) for line in (tmp_path / "league" / "transcripts.jsonl").read_text().splitlines()]
    assert any("me" in e["players"].values() for e in episodes if e["kind"] == "train")
    assert [r["step"] for r in read_metrics(tmp_path / "league")] == [1, 2, 3, 4, 5, 5]
    # The pool's oldest version is older than the two per-step versions the runtime keeps, and its
    # sampler still samples.
    import asyncio

    from polytinker.engine.types import SamplingParams

    oldest = min(state.pool["me"])
    assert oldest < state.versions["me"] - 1
    sampler = experiment._trainer.players.samplers[("me", oldest)]
    reply = asyncio.run(sampler.sample_async([1, 2, 3], 1, SamplingParams(max_tokens=2)))
    assert len(reply.sequences) == 1


def test_a_league_with_a_frozen_agent_ends_with_a_repeatable_cross_play(service, tmp_path):
    """The frozen agent is one of the league's opponents in training; after it, the final agent
    plays it and the pool's other versions, every pair on the same seeds, both seats."""
    config = ExperimentConfig(
        name="cross",
        env=EnvSetup("kuhn_poker-v0"),
        agents=(agent("me", "reinforce"), dataclasses.replace(agent("base"), trainable=False)),
        mapping=MappingConfig(kind="league", pool_every=1),  # type: ignore[arg-type]
        train=TrainConfig(steps=2, groups=4, group_size=1),
        eval=EvalConfig(episodes=2, at_start=False, cross_play_episodes=4),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    experiment = Experiment(config)
    experiment.train(service=service)
    run = tmp_path / "cross"
    table = CrossPlay.load(run)
    state = RunState.load(run)
    past = [f"me@v{v}" for v in state.pool["me"] if v != state.versions["me"]]
    assert past and table is not None and table.rows == ("me",) and table.columns == ("base", *past)
    assert all(r.games + r.aborted == 4 for r in table.results["me"].values())
    assert set(table.elo) == {"me", "base", *past}
    episodes = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert any("base" in e["players"].values() for e in episodes if e["kind"] == "train")
    crossed = [e for e in episodes if e["kind"] == "crossplay"]
    assert {tuple(sorted(e["players"].values())) for e in crossed} == {tuple(sorted(("me", c))) for c in table.columns}
    # Played again, the same draws: the evaluation's per-decision seeds.
    import asyncio

    assert experiment._trainer is not None
    assert asyncio.run(experiment._trainer.cross_play()).results == table.results
    assert cli.main(["show", str(run), "-n", "0"]) == 0


def test_the_train_command_prints_the_cross_play_table_as_show_does(tmp_path, capsys):
    """``polytinker train`` of a league with a frozen agent and cross-play ends with the table and
    the Elo that ``polytinker show`` prints for the run (in-process runtime, one step)."""
    path = tmp_path / "league.toml"
    path.write_text(
        f'name = "cli-cross"\n[env]\nid = "kuhn_poker-v0"\n'
        f'[[agents]]\nname = "me"\nbase_model = "{TINY}"\n[agents.algorithm]\nname = "reinforce"\n'
        f"[agents.sampling]\nmax_tokens = 4\n"
        f'[[agents]]\nname = "base"\nbase_model = "{TINY}"\ntrainable = false\n[agents.sampling]\nmax_tokens = 4\n'
        f'[mapping]\nkind = "league"\npool_every = 1\n[train]\nsteps = 1\ngroups = 2\ngroup_size = 1\n'
        f"[eval]\nepisodes = 1\nat_start = false\ncross_play_episodes = 2\n"
        f'[output]\nroot = "{tmp_path}"\nprogress = false\ntensorboard = false\n[runtime]\nmode = "inproc"\n'
    )
    assert cli.main(["train", str(path), "--no-progress"]) == 0
    trained = capsys.readouterr().out
    table = CrossPlay.load(tmp_path / "cli-cross")
    assert table is not None and table.rows == ("me",) and "base" in table.columns
    rendered = table.render()
    assert rendered in trained and trained.index("run ") < trained.index("cross-play: 2 episodes a pair")
    assert cli.main(["show", str(tmp_path / "cli-cross"), "-n", "0"]) == 0
    assert rendered in capsys.readouterr().out


def test_sft_from_jsonl_lowers_the_loss(service, tmp_path):
    data = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Say seven."}, {"role": "assistant", "content": "7"}]}
    data.write_text("\n".join(json.dumps(chat) for _ in range(4)) + "\n")
    spec = AgentSpec(
        "tutor",
        base_model=TINY,
        algorithm=AlgorithmConfig(name="sft", sft_data=str(data), learning_rate=1e-2),  # type: ignore[arg-type]
    )
    client, losses = train_sft(spec, service, epochs=4, batch_size=4)
    assert losses[-1] < losses[0] * 0.7, losses
    client.finish()


def test_train_command_reports_a_bad_config(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "missing.toml")]) == 1
    assert "cannot read experiment config" in capsys.readouterr().err


def test_runtime_mode_inproc_trains_in_this_process(tmp_path, monkeypatch):
    """``[runtime] mode = "inproc"``: the experiment's own runtime starts no process."""

    def no_process(*args, **kw):
        raise AssertionError(f"an in-process runtime started a process: {args}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    config = dataclasses.replace(
        pd_config(tmp_path, "here", steps=1),
        eval=EvalConfig(episodes=1, at_start=False),
        runtime=RuntimeSetup(micro_batch_size=32, mode="inproc"),  # type: ignore[arg-type]
    )
    Experiment(config).train()
    assert [r["step"] for r in read_metrics(tmp_path / "here")] == [1, 1]
    assert RunState.load(tmp_path / "here").step == 1
    for bad, match in ((dict(mode="threads"), "runtime.mode"), (dict(mode="inproc", address="tcp://h:1"), "address")):
        with pytest.raises(ConfigError, match=match):
            RuntimeSetup(**bad)  # type: ignore[arg-type]


def full_agent(name: str) -> AgentSpec:
    return AgentSpec(
        name,
        base_model=TINY,
        adapter=AdapterSpec(full=True),
        algorithm=AlgorithmConfig(name="reinforce", learning_rate=1e-4),  # type: ignore[arg-type]
        sampling=SamplingConfig(max_tokens=4),
    )


def test_full_parameter_agent_trains_with_rl_in_async_mode(service, tmp_path):
    """A full-parameter agent samples its own versions (each a whole model on the engine) while
    the next step trains."""
    config = ExperimentConfig(
        name="full",
        env=EnvSetup("kuhn_poker-v0"),  # the random model's invalid answers fall back to varied seeded moves
        agents=(full_agent("solo"),),
        mapping=MappingConfig(kind="self_play"),  # type: ignore[arg-type]
        train=TrainConfig(steps=2, groups=2, group_size=2, mode="async", max_staleness=1),  # type: ignore[arg-type]
        eval=EvalConfig(episodes=2, at_start=False),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    experiment = Experiment(config)
    experiment.train(service=service)
    rows = read_metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == [1, 2, 2]
    assert rows[1]["version/solo"] == 2 and rows[0]["train/datums/solo"] > 0
    assert experiment._trainer is not None
    sampler = experiment._trainer.players.samplers[("solo", 2)]
    assert sampler.model_path.endswith("/solo@2")
    stats = service.runtime_status()["stats"]["engine-0"]
    assert stats["full_weight_loads"] >= 2  # versions 0 (or 1) and 2 were sampled as whole models


def test_too_few_learner_groups_for_full_parameter_agents_is_refused(service, tmp_path):
    config = ExperimentConfig(
        name="two-full",
        env=EnvSetup("prisoners_dilemma-v0", {"rounds": 1}),
        agents=(full_agent("alice"), agent("bob", "reinforce")),
        train=TrainConfig(steps=1, groups=1, group_size=1),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    with pytest.raises(Exception, match=r"2 learner groups .* the runtime has 1"):
        Experiment(config).train(service=service)


def test_an_agent_calls_its_envs_tool_and_trains_on_what_it_wrote(service, tmp_path):
    """The tool loop with the real engine: the answer prefix opens a calculator call, so every
    turn runs the tool, shows its result and samples the answer; the multi-turn episode (two
    attempts) trains as datums with the tool results masked."""
    from polytinker.agents import RendererConfig

    solver = dataclasses.replace(
        agent("solver", "reinforce"),
        sampling=SamplingConfig(max_tokens=6),
        renderer=RendererConfig(answer_prefix="<calculator>"),
    )
    config = ExperimentConfig(
        name="tools",
        env=EnvSetup("math_tool-v0", {"attempts": 2}),
        agents=(solver,),
        train=TrainConfig(steps=1, groups=2, group_size=2),
        eval=EvalConfig(episodes=2, at_start=False, win="positive"),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    Experiment(config).train(service=service)
    rows = read_metrics(tmp_path / "tools")
    assert rows[0]["tool_calls/solver"] >= 1.0  # every turn opened a call
    assert 0.0 <= rows[0]["tool_error_rate/solver"] <= 1.0
    # The tokens the model wrote: the calls' and answers' (tool results are not counted).
    assert rows[0]["tokens/solver"] > 0
    assert rows[0]["train/datums/solver"] > 0 or rows[0].get("train/skipped/solver") == 1.0
    # The transcript shows each call and what the model was shown back.
    episodes = [json.loads(line) for line in (tmp_path / "tools" / "transcripts.jsonl").read_text().splitlines()]
    turn = episodes[0]["turns"]["player_0"][0]
    assert turn["meta"]["tool_calls"] == 1
    (exchange,) = turn["meta"]["tools"]
    assert exchange["tool"] == "calculator" and exchange["result"]


def test_constrained_moves_are_always_legal_and_train(service, tmp_path):
    """constrain_moves with the real engine: a random model, which otherwise answers off the list,
    plays only legal text-world moves (no invalid answer in training or evaluation), and the
    datums train on the tokens it was made to write."""
    from polytinker.agents import RendererConfig

    householder = dataclasses.replace(
        agent("householder"), sampling=SamplingConfig(max_tokens=2), renderer=RendererConfig(constrain_moves=True)
    )
    kwargs = {"receptacles": 3, "info_commands": False, "max_steps": 4}
    config = ExperimentConfig(
        name="constrained",
        env=EnvSetup("textworld-v0", kwargs),
        agents=(householder,),
        train=TrainConfig(steps=1, groups=2, group_size=2),
        eval=EvalConfig(episodes=2, win="solved"),
        output=OutputConfig(root=str(tmp_path), progress=False, tensorboard=False),
    )
    Experiment(config).train(service=service)
    rows = read_metrics(tmp_path / "constrained")
    assert rows[1]["invalid_rate/householder"] == 0.0  # rows[0]: the evaluation before training
    episodes = [json.loads(line) for line in (tmp_path / "constrained" / "transcripts.jsonl").read_text().splitlines()]
    turns = [t for e in episodes for t in e["turns"]["player_0"]]
    assert len(turns) >= 4 and not any(t.get("invalid") for t in turns)
    # Whole moves although max_tokens=2: a constrained answer may be as long as its longest choice.
    assert all(t["action"].startswith(("go to ", "open ", "close ", "take ", "put ")) for t in turns)
