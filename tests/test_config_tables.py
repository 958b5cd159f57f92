"""Config tables (polytinker.tables): a wrong type in the experiment TOML, a --set override or an
env config names the field and the type it wants, for every config dataclass loaded from a table."""

from __future__ import annotations

from pathlib import Path

import pytest

from polytinker.agents.config import ExperimentConfig, TrainConfig
from polytinker.envs import EnvConfig
from polytinker.errors import ConfigError
from polytinker.tables import check_types, describe, from_table

BASE = 'name = "x"\n[[agents]]\nname = "alice"\n'


def load(tmp_path: Path, text: str, overrides: dict | None = None) -> ExperimentConfig:
    path = tmp_path / "x.toml"
    path.write_text(BASE + text)
    return ExperimentConfig.from_toml(path, overrides)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[train]\nsteps = "ten"\n', "train.steps: expected int, got str 'ten'"),
        ("[train]\nsteps = 2.5\n", "train.steps: expected int, got float 2.5"),
        ("[train]\nmode = 1\n", "train.mode: expected one of 'sync', 'async', got int 1"),
        ('[eval]\nopponents = "random"\n', "eval.opponents: expected array of str, got str 'random'"),
        ("[eval]\nopponents = [1]\n", r"eval.opponents\[0\]: expected str, got int 1"),
        ('[output]\nprogress = "no"\n', "output.progress: expected bool, got str 'no'"),
        ("[runtime]\nbackend = 3\n", "runtime.backend: expected one of 'hf', 'vllm', got int 3"),
        ("[env]\nkwargs = 3\n", "env.kwargs: expected table, got int 3"),
        ('[env]\nmax_retries = "2"\n', "env.max_retries: expected int, got str '2'"),
        ("[mapping]\nroles = { player_0 = 1 }\n", r"mapping.roles\['player_0'\]: expected str, got int 1"),
        (
            '[agents.sampling]\nmax_tokens = "8"\n',
            r"agents\['alice'\].sampling.max_tokens: expected int, got str '8'",
        ),
        ("[agents.algorithm]\nlearning_rate = true\n", r"agents\['alice'\].algorithm.learning_rate: expected float"),
        ("[agents.adapter]\ntarget_modules = [1]\n", r"agents\['alice'\].adapter.target_modules\[0\]: expected str"),
    ],
)
def test_a_wrong_type_names_the_field_and_the_expected_type(tmp_path, toml, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, toml)


def test_overrides_are_checked_too_and_ints_become_floats(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: expected int, got str 'ten'"):
        load(tmp_path, "", {"train.steps": "ten"})
    with pytest.raises(ConfigError, match="train: expected table, got int 3"):
        load(tmp_path, "", {"train": 3})
    config = load(tmp_path, "[agents.algorithm]\nlearning_rate = 1\n[eval]\nopponents = ['heuristic']\n")
    rate = config.agents[0].algorithm.learning_rate
    assert rate == 1.0 and isinstance(rate, float) and config.eval.opponents == ("heuristic",)


def test_missing_and_unknown_keys(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('name = "x"\n[[agents]]\nbase_model = "tiny-random"\n')
    with pytest.raises(ConfigError, match=r"agents\[0\]: missing name \(no default\)"):
        ExperimentConfig.from_toml(path)
    with pytest.raises(ConfigError, match=r"train: unknown keys \['stepz'\]"):
        from_table(TrainConfig, {"stepz": 1}, "train")


def test_env_config_tables_are_checked_by_the_same_checker():
    config = from_table(EnvConfig, {"max_retries": 0, "invalid_action_penalty": -1}, "config")
    assert config.invalid_action_penalty == -1.0
    with pytest.raises(ConfigError, match=r"config\.on_retries_exhausted: expected one of 'fallback', 'forfeit'"):
        check_types(EnvConfig, {"on_retries_exhausted": "resign"}, "config")
    assert describe(tuple[str, ...]) == "array of str" and describe(dict[str, str]) == "table of str"


def test_the_runtime_config_of_polytinker_serve_is_checked_the_same_way(tmp_path):
    from polytinker.scheduler.service.config import RuntimeConfig

    path = tmp_path / "runtime.toml"
    path.write_text('model = "tiny-random"\n[[engines]]\nengine_id = "e1"\nadapter_slots = "2"\n')
    with pytest.raises(ConfigError, match=r"engines\[0\]\.adapter_slots: expected int, got str '2'"):
        RuntimeConfig.from_toml(path)
    path.write_text('model = "tiny-random"\n[jobs]\nsteps = 5\nstepz = 1\n')
    with pytest.raises(ConfigError, match=r"jobs: unknown keys \['stepz'\]"):
        RuntimeConfig.from_toml(path)


def test_constrained_answers_on_the_vllm_backend_are_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"constrain_moves.*runtime\.backend = 'vllm' does not"):
        load(tmp_path, '[agents.renderer]\nconstrain_moves = true\n[runtime]\nbackend = "vllm"\n')
    assert load(tmp_path, "[agents.renderer]\nconstrain_moves = true\n").agents[0].renderer.constrain_moves
