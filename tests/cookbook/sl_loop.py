"""tinker-cookbook's supervised loop (``tinker_cookbook.supervised.train``: its Config and main,
unmodified) against a Tinker API server, on a small chat dataset rendered with the cookbook's
``role_colon`` renderer through its own ``FromConversationFileBuilder``.

Prints each step's training NLL (``train_mean_nll``) and the held-out NLL its SamplerNLLEvaluator
measured, and exits non-zero unless the training NLL fell.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python tests/cookbook/sl_loop.py [LOG_DIR]
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from _common import MODEL, RENDERER, fail, metrics, run_script

FACTS = [
    ("What colour is the sky?", "Blue."),
    ("What colour is grass?", "Green."),
    ("What colour is snow?", "White."),
    ("What colour is coal?", "Black."),
    ("What colour is a banana?", "Yellow."),
    ("What colour is a tomato?", "Red."),
    ("What colour is an orange?", "Orange."),
    ("What colour is a plum?", "Purple."),
    ("What colour is the sea?", "Blue."),
    ("What colour is milk?", "White."),
]


def write_conversations(path: Path) -> None:
    with path.open("w") as f:
        for question, answer in FACTS:
            convo = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": convo}) + "\n")


def main(log_dir: Path) -> None:
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    log_dir.mkdir(parents=True, exist_ok=True)
    data = log_dir / "conversations.jsonl"
    write_conversations(data)
    log_path = log_dir / "run"
    config = train.Config(
        log_path=str(log_path),
        model_name=MODEL,
        recipe_name="polytinker_sl_loop",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data),
            test_size=2,
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=64, batch_size=2
            ),
        ),
        learning_rate=3e-3,
        lr_schedule="constant",
        num_epochs=3,
        lora_rank=8,
        save_every=0,
        eval_every=4,
    )
    asyncio.run(train.main(config))

    rows = metrics(log_path)
    train_nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    test_nll = [(r["step"], r["test/nll"]) for r in rows if "test/nll" in r]
    print("train_mean_nll:", " ".join(f"{x:.3f}" for x in train_nll))
    print("test/nll:", " ".join(f"step {s}: {x:.3f}" for s, x in test_nll))
    if len(train_nll) < 6:
        fail(f"expected at least 6 training steps, got {len(train_nll)}")
    first, last = sum(train_nll[:2]) / 2, sum(train_nll[-2:]) / 2
    print(f"first two steps {first:.3f} -> last two {last:.3f}")
    if not last < 0.7 * first:
        fail(f"the training NLL did not fall ({first:.3f} -> {last:.3f})")
    print("OK sl_loop")


if __name__ == "__main__":
    run_script(main)
