"""What an agent is: a frozen spec per agent, with one frozen dataclass per concern.

- ``AdapterSpec``: the LoRA adapter (rank, alpha, target modules), or ``full`` parameters.
- ``AlgorithmConfig``: the RL (or SFT) algorithm and its settings.
- ``SamplingConfig``: how the agent's actions are sampled.
- ``RendererConfig``: how observations become chat prompts.
- ``AgentSpec``: name, base model, the four above, and whether it trains.

Every field is checked in ``__post_init__``; the message says how to fix it. ``from_dict`` builds
a spec from a TOML table (unknown keys and wrong types are errors: ``polytinker.tables``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from polytinker.agents.types import AlgorithmName
from polytinker.envs.tools import FORMATS
from polytinker.errors import ConfigError
from polytinker.tables import check_keys, from_table
from polytinker.types import DEFAULT_TARGET_MODULES

DEFAULT_BASE_MODEL = "smollm2-135m-instruct"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int = 16
    # LoRA rank of the agent's adapter.
    alpha: int = 32
    # LoRA alpha (the update is scaled by alpha / rank).
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    # Linear layers that get LoRA factors (projection names of the base model).
    full: bool = False
    # True: train every weight of the base model instead (a learner group to itself; engines
    # serve each version as a whole model, so no KL term against the base model).

    def __post_init__(self) -> None:
        if self.rank <= 0 or self.alpha <= 0:
            raise ConfigError(f"AdapterSpec: rank and alpha must be positive, got {self.rank} and {self.alpha}")
        if not self.target_modules:
            raise ConfigError("AdapterSpec.target_modules must name at least one module, e.g. ['q_proj', 'v_proj']")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass(frozen=True)
class AlgorithmConfig:
    name: AlgorithmName = AlgorithmName.GRPO
    # "grpo" (group-normalised advantages), "ppo" (clipped ratios, several passes), "reinforce"
    # (a running-mean baseline), or "sft" (cross-entropy on JSONL conversations).
    learning_rate: float = 1e-4
    # AdamW step size of every optimizer step.
    kl_coef: float = 0.0
    # Weight of the KL penalty against the base model (the adapter disabled); 0 skips the
    # reference forward pass (half the learner time).
    reward_mode: Literal["episode", "per_turn"] = "episode"
    # "episode": every turn is scored by the episode's total reward; "per_turn": by its
    # discounted return from that turn on (uses the env's per-turn rewards).
    gamma: float = 1.0
    # Discount of per_turn returns.
    clip_epsilon: float = 0.2
    # ppo: the probability ratio is clipped to [1 - eps, 1 + eps].
    epochs: int = 1
    # ppo: passes over each batch (ratios move away from 1 after the first optimizer step).
    minibatches: int = 1
    # Optimizer steps per pass: the batch is split into this many parts.
    baseline_decay: float = 0.9
    # reinforce: the baseline is an exponential moving average of returns with this decay.
    normalize_advantages: bool = True
    # grpo: divide by the group's std; reinforce/ppo: by the batch's std.
    sft_data: str = ""
    # sft: a JSONL file, one {"messages": [{"role": ..., "content": ...}, ...]} per line.
    merge_turns: bool = True
    # The turns of one episode whose prompts extend each other (renderer history = "full") become
    # one datum: the learner scores the trajectory once instead of each turn's whole history.

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "name", AlgorithmName(self.name))
        except ValueError:
            raise ConfigError(
                f"AlgorithmConfig.name {self.name!r}: choose one of {[a.value for a in AlgorithmName]}"
            ) from None
        if not self.learning_rate > 0:
            raise ConfigError(f"AlgorithmConfig.learning_rate must be > 0, got {self.learning_rate}")
        if self.kl_coef < 0:
            raise ConfigError(f"AlgorithmConfig.kl_coef must be >= 0, got {self.kl_coef}")
        if self.reward_mode not in ("episode", "per_turn"):
            raise ConfigError(f"AlgorithmConfig.reward_mode must be 'episode' or 'per_turn', got {self.reward_mode!r}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"AlgorithmConfig.gamma must be in (0, 1], got {self.gamma}")
        if not 0 < self.clip_epsilon < 1:
            raise ConfigError(f"AlgorithmConfig.clip_epsilon must be in (0, 1), got {self.clip_epsilon}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError("AlgorithmConfig: epochs and minibatches must be >= 1")
        if not 0 <= self.baseline_decay < 1:
            raise ConfigError(f"AlgorithmConfig.baseline_decay must be in [0, 1), got {self.baseline_decay}")
        if self.name is AlgorithmName.SFT and not self.sft_data:
            raise ConfigError("AlgorithmConfig: name='sft' needs sft_data, a JSONL file of conversations")


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 8
    # Longest action in tokens: short answers keep rollouts fast.
    temperature: float = 1.0
    # Sampling temperature of training rollouts (exploration).
    top_p: float = 1.0
    # Nucleus sampling threshold.
    eval_temperature: float = 0.7
    # Temperature of evaluation episodes.

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ConfigError(f"SamplingConfig.max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0 or self.eval_temperature < 0:
            raise ConfigError("SamplingConfig: temperatures must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class RendererConfig:
    history: Literal["full", "none"] = "full"
    # "full": earlier turns of the episode are in the prompt (as user/assistant messages);
    # "none": only the current observation (shorter prompts, for games whose text holds the state).
    list_legal_moves: bool = True
    # Append "Legal moves: a, b, c." to the observation when the env lists them.
    max_listed_moves: int = 16
    # Do not list more moves than this (guess-the-number has 100).
    numbered_moves: bool = False
    # List the legal moves numbered ("1. go to cabinet 1") and let the agent answer with a number:
    # the policy sends the env the move it names. A one- or two-token answer that a small model
    # gets right where the moves are long; an answer that names no listed number goes to the env
    # as written (and is refused there, in the metrics like any invalid answer).
    constrain_moves: bool = False
    # The answer is one of the env's legal moves (or, with numbered_moves, one of the listed
    # numbers), then the end of the turn: the engine scores each whole move and draws one by the
    # model's probability of it, so a small model never answers off the list (hf engine backend).
    # The datum and its logprobs are the model's own tokens and scores; invalid answers cannot
    # happen, so they stay at 0 in the metrics. Not with tools (an answer that may be a tool call
    # is not a move).
    name_role: bool = False
    # Tell the agent which env role it plays ("You are player_1."): needed for self-play.
    system_prompt: str = ""
    # Replaces the env's instructions as the system prompt (a shorter prompt is a faster one).
    system_suffix: str = ""
    # Text appended to the system prompt.
    answer_prefix: str = ""
    # The start of the agent's reply, written into the prompt after the generation prompt
    # (e.g. "My move (cooperate or defect):"): it primes the answer format for a small model.
    # Part of the prompt, so never trained on; the env parses only what the model adds.
    answer_prefix_after_tool: str = ""
    # The start of the agent's reply after a tool's result (e.g. "The answer is"): written into
    # the prompt after the result message, as answer_prefix is after the observation, so a small
    # model goes on to use the result. Never trained on.
    tool_format: str = "tags"
    # How the agent writes a tool call, when the env gives it tools: "tags"
    # (<calculator>12*7</calculator>, what a small model copies best) or "json" (Hermes/Qwen style
    # <tool_call>{"name": ..., "arguments": ...}</tool_call>).
    tool_role: str = "tool"
    # The chat role of a tool's result message (a template without it shows a user message).

    def __post_init__(self) -> None:
        if self.history not in ("full", "none"):
            raise ConfigError(f"RendererConfig.history must be 'full' or 'none', got {self.history!r}")
        if self.max_listed_moves < 0:
            raise ConfigError(f"RendererConfig.max_listed_moves must be >= 0, got {self.max_listed_moves}")
        if self.tool_format not in FORMATS:
            raise ConfigError(f"RendererConfig.tool_format {self.tool_format!r}: choose one of {sorted(FORMATS)}")
        if not self.tool_role:
            raise ConfigError("RendererConfig.tool_role must name a chat role, e.g. 'tool'")


@dataclass(frozen=True)
class AgentSpec:
    name: str
    # The agent's name: its adapter, metrics and checkpoints are named after it.
    base_model: str = DEFAULT_BASE_MODEL
    # The base model (a preset, directory or hub id); every agent of one experiment shares it.
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    # The adapter it trains.
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    # How it learns.
    trainable: bool = True
    # False: a frozen agent (the base model, or a saved adapter version in model_path).
    model_path: str = ""
    # Frozen agents: a sampler path (polytinker://JOB/AGENT@VERSION) to play; empty: the base model.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # How its actions are sampled.
    renderer: RendererConfig = field(default_factory=RendererConfig)
    # How its prompts are rendered.
    seed: int = 0
    # Seed of the adapter's initialisation.

    def __post_init__(self) -> None:
        if not self.name or not set(self.name) <= _NAME_CHARS or len(self.name) > 48:
            raise ConfigError(f"AgentSpec.name {self.name!r}: use 1-48 letters, digits, '_', '-' or '.'")
        if not self.base_model:
            raise ConfigError(f"agent {self.name}: base_model must name a model (e.g. {DEFAULT_BASE_MODEL!r})")
        if self.model_path and self.trainable:
            raise ConfigError(f"agent {self.name}: model_path is for frozen agents; set trainable = false")
        if self.adapter.full and self.algorithm.kl_coef > 0:
            raise ConfigError(
                f"agent {self.name}: a KL term against the base model needs a LoRA adapter (the base weights "
                "are the adapter-free pass); set algorithm.kl_coef = 0 or adapter.full = false"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AgentSpec:
        """Build from a TOML table: ``[[agents]] name = ... [agents.adapter] rank = ...``; unknown
        keys and wrong types are errors naming the field (``polytinker.tables``)."""
        name = raw.get("name", "?") if isinstance(raw, dict) else "?"
        return from_table(cls, raw, f"agents[{name!r}]")


__all__ = [
    "DEFAULT_BASE_MODEL",
    "AdapterSpec",
    "AgentSpec",
    "AlgorithmConfig",
    "RendererConfig",
    "SamplingConfig",
    "check_keys",
]
