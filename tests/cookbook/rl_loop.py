"""tinker-cookbook's RL loop (``tinker_cookbook.rl.train``: its Config and main, unmodified)
against a Tinker API server, synchronous and then asynchronous (``AsyncConfig``), on a "say the
word" task built from the cookbook's own types: a ``ProblemEnv`` whose answer is right when the
completion contains the word, grouped by ``ProblemGroupBuilder``, served by an ``RLDataset`` that
an ``RLDatasetBuilder`` makes.

Prints each step's mean reward and the sampler checkpoints the loop made (their versions), and
exits non-zero unless every step computed rewards and trained, and the versions advanced.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python tests/cookbook/rl_loop.py [LOG_DIR]
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path

import chz
from _common import MODEL, RENDERER, checkpoints, fail, metrics, run_script, sampler_version
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import Action, ActionExtra, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer

WORDS = ["blue", "seven", "apple", "river", "green", "tiger"]
REWARD_KEY = "env/all/reward/total"


class SayTheWord(ProblemEnv):
    """Reward 1 when the completion contains the word (and the format bonus of ProblemEnv); short
    of it, a tenth of the share of the word's letters the completion has. That partial credit
    gives a model that never says the word (tiny-random's random weights, which also never stop
    before max_tokens and so never earn the format bonus) rewards that differ within a group, so
    its steps train too."""

    def __init__(self, renderer: renderers.Renderer, word: str) -> None:
        super().__init__(renderer, format_coef=0.1, require_stop_sequence_for_format=False)
        self.word = word

    def get_question(self) -> str:
        return f"Say the word {self.word}."

    def check_answer(self, sample_str: str) -> bool:
        return self.word in sample_str.lower()

    def check_format(self, sample_str: str) -> bool:
        return bool(sample_str.strip())

    def get_reference_answer(self) -> str:
        return self.word

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        result = await super().step(action, extra=extra)
        text = renderers.get_text_content(self.renderer.parse_response(action)[0]).lower()
        if self.word not in text:
            letters = set(self.word)
            result.reward += 0.1 * sum(c in text for c in letters) / len(letters)
        return result


class SayTheWordDataset(RLDataset):
    def __init__(self, renderer: renderers.Renderer, batch_size: int, group_size: int) -> None:
        self.renderer, self.batch_size, self.group_size = renderer, batch_size, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        words = [WORDS[(index * self.batch_size + i) % len(WORDS)] for i in range(self.batch_size)]
        return [
            ProblemGroupBuilder(
                env_thunk=lambda w=w: SayTheWord(self.renderer, w), num_envs=self.group_size, dataset_name="say"
            )
            for w in words
        ]

    def __len__(self) -> int:
        return len(WORDS)


@chz.chz
class SayTheWordBuilder(RLDatasetBuilder):
    batch_size: int = 2
    group_size: int = 4

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL))
        return SayTheWordDataset(renderer, self.batch_size, self.group_size), None


def run(log_path: Path, steps: int, async_mode: bool) -> list[float]:
    """One cookbook RL run; the mean reward of each step it trained."""
    config = train.Config(
        learning_rate=1e-4,
        dataset_builder=SayTheWordBuilder(),
        model_name=MODEL,
        recipe_name="polytinker_rl_loop",
        renderer_name=RENDERER,
        max_tokens=12,
        log_path=str(log_path),
        lora_rank=4,
        eval_every=0,
        save_every=1,  # a sampler checkpoint every step: the versions the loop samples from
        max_steps=steps,
        num_groups_to_log=0,
        async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2) if async_mode else None,
    )
    asyncio.run(train.main(config))
    rows = [r for r in metrics(log_path) if REWARD_KEY in r]
    for r in rows:
        if not math.isfinite(r[REWARD_KEY]) or not r.get("env/all/total_episodes"):
            fail(f"a step without rewards: {r}")
    label = "async" if async_mode else "sync"
    print(f"{label} correct per step:", " ".join(f"{r['env/all/correct']:.3f}" for r in rows))
    print(f"{label} trained tokens per step:", " ".join(f"{r.get('optim:tokens', 0):.0f}" for r in rows))
    if async_mode:
        print("async sampler step per step:", " ".join(str(r.get("sampling_client/step_max")) for r in rows))
    if not any(r.get("optim:tokens", 0) > 0 for r in rows):
        fail(f"{label}: no step trained on a token (every group's rewards were constant)")
    return [r[REWARD_KEY] for r in rows]


def check_versions(log_path: Path, label: str, trained_steps: int) -> None:
    """Each step saved sampler weights of a newer version (one optimizer step per RL step)."""
    records = checkpoints(log_path)
    saved = [(r["name"], sampler_version(r["sampler_path"])) for r in records if r.get("sampler_path")]
    print(f"{label} sampler checkpoints:", " ".join(f"{name}@{v}" for name, v in saved))
    versions = [v for _, v in saved]
    if len(versions) < 2 or versions != sorted(versions) or versions[-1] != trained_steps:
        fail(f"{label}: the sampler versions did not advance to {trained_steps}: {saved}")


def main(log_dir: Path) -> None:
    for label, async_mode, steps in (("sync", False, 3), ("async", True, 4)):
        rewards = run(log_dir / label, steps, async_mode)
        print(f"{label} reward per step:", " ".join(f"{x:.3f}" for x in rewards))
        # Async: a group sampled more than max_steps_off_policy versions ago is requeued, or
        # dropped once the dataset is exhausted, so the last step can go without its batch.
        if len(rewards) != steps and not (async_mode and 2 <= len(rewards) < steps):
            fail(f"{label}: {len(rewards)} steps logged rewards, expected {steps}")
        check_versions(log_dir / label, label, len(rewards))
    print("OK rl_loop")


if __name__ == "__main__":
    run_script(main)
