"""TRL's half of ``benchmarks/train.py``: ``GRPOTrainer`` on the reference task.

    benchmarks/.venv-trl/bin/python benchmarks/_trl_grpo.py MODEL_DIR --steps 30 [--threads 2]

Runs in TRL's own virtual environment (``train.py`` builds it on first use): polytinker is not
importable here, so the model comes as a local directory and the task from ``_train_task.py``.
Settings: 8 completions per step in one group, at most 16 new tokens, learning rate 5e-4,
``beta=0``, LoRA r=16 / alpha=32 on q,k,v,o,gate,up,down, fp32 on the CPU; everything else TRL's
defaults. Prints one JSON line per step (mean reward, completion tokens, seconds) and a ``done`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _train_task import (
    GROUP_SIZE,
    LEARNING_RATE,
    LORA_ALPHA,
    LORA_RANK,
    MAX_NEW_TOKENS,
    PROMPT,
    SEED,
    TARGET_MODULES,
    reward,
)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes conversational completions as a list of messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tag", default="trl")
    args = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    t_import = time.time()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    step_info: dict[str, float] = {}

    def reward_fn(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any) -> list[float]:
        rewards = [reward(completion_text(c)) for c in completions]
        step_info["reward_mean"] = sum(rewards) / len(rewards)
        step_info["completion_tokens"] = sum(len(ids) for ids in completion_ids)
        return rewards

    tag = args.tag

    class Timer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_info["t_start"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            t_end = time.time()
            emit(
                {
                    "agent": tag,
                    "step": int(state.global_step),
                    "reward_mean": step_info.get("reward_mean", 0.0),
                    "completion_tokens": int(step_info.get("completion_tokens", 0)),
                    "step_s": t_end - step_info["t_start"],
                    "t_start": step_info["t_start"],
                    "t_end": t_end,
                }
            )

    config = GRPOConfig(
        output_dir=os.environ.get("TMPDIR", "/tmp") + f"/polytinker-bench-trl-{os.getpid()}",
        num_generations=GROUP_SIZE,
        per_device_train_batch_size=GROUP_SIZE,  # one group of 8 completions per step
        max_completion_length=MAX_NEW_TOKENS,
        learning_rate=LEARNING_RATE,
        beta=0.0,
        max_steps=args.steps,
        seed=SEED,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": PROMPT}]}] * (args.steps * GROUP_SIZE))
    lora = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(TARGET_MODULES), lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Timer()],
    )
    emit({"agent": args.tag, "event": "ready", "setup_s": time.time() - t_import})
    trainer.train()
    emit(
        {"agent": args.tag, "event": "done", "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    )


if __name__ == "__main__":
    main()
