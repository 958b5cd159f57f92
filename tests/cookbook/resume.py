"""A tinker-cookbook run that stops part-way and a second run in the same log directory that
resumes from the checkpoint the first left, through the cookbook's own ``checkpoint_utils`` (as
``tinker_cookbook.supervised.train`` uses them: periodic ``save_checkpoint_async``,
``get_last_checkpoint``, ``create_training_client_from_state_with_optimizer``, the renderer check
against the checkpoint's training run).

The first run's dataset fails at a batch (a crash after a periodic checkpoint); the second run,
with the same config, picks up at that checkpoint's batch with its weights. Then the SDK's
``RestClient`` reads the run back: the training run of the checkpoint (its renderer metadata),
its checkpoints, and the checkpoint's weights info; and the cookbook's ``weights.download`` of the
checkpoint gives its peft adapter directory. Prints the steps and NLLs of both runs;
exits non-zero unless the second run resumed where the checkpoint says and from its weights.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... python tests/cookbook/resume.py [LOG_DIR]
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import chz
import tinker
from _common import MODEL, RENDERER, checkpoints, fail, metrics, run_script
from sl_loop import write_conversations
from tinker_cookbook import checkpoint_utils, weights
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig, SupervisedDataset

CRASH_AT_BATCH = 4
SAVE_EVERY = 2


class PlannedCrash(RuntimeError):
    pass


class CrashingDataset(SupervisedDataset):
    """The cookbook dataset, failing at one batch: the interruption of the first run."""

    def __init__(self, inner: SupervisedDataset, crash_at: int) -> None:
        self.inner, self.crash_at = inner, crash_at

    def get_batch(self, index: int) -> list[tinker.Datum]:
        if index == self.crash_at:
            raise PlannedCrash(f"the first run stops at batch {index}")
        return self.inner.get_batch(index)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, seed: int = 0) -> None:
        self.inner.set_epoch(seed)


@chz.chz
class MaybeCrashingBuilder(FromConversationFileBuilder):
    crash_at: int = -1

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        train_ds, test_ds = super().__call__()
        return (CrashingDataset(train_ds, self.crash_at) if self.crash_at >= 0 else train_ds), test_ds


def config(log_path: Path, data: Path, crash_at: int) -> train.Config:
    return train.Config(
        log_path=str(log_path),
        model_name=MODEL,
        recipe_name="polytinker_resume",
        renderer_name=RENDERER,
        dataset_builder=MaybeCrashingBuilder(
            file_path=str(data),
            crash_at=crash_at,
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=64, batch_size=2
            ),
        ),
        learning_rate=3e-3,
        lr_schedule="constant",
        num_epochs=1,
        lora_rank=8,
        save_every=SAVE_EVERY,
    )


def nll_rows(log_path: Path) -> list[tuple[int, float]]:
    """(step, training NLL) in the order logged: the second run appends to the first's file."""
    return [(int(r["step"]), float(r["train_mean_nll"])) for r in metrics(log_path) if "train_mean_nll" in r]


def show(rows: list[tuple[int, float]]) -> str:
    return " ".join(f"{s}:{x:.3f}" for s, x in rows)


def main(log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    data = log_dir / "conversations.jsonl"
    write_conversations(data)
    log_path = log_dir / "run"

    try:
        asyncio.run(train.main(config(log_path, data, CRASH_AT_BATCH)))
        fail("the first run was meant to stop part-way")
    except PlannedCrash as exc:
        print(f"first run stopped: {exc}")
    first = nll_rows(log_path)
    found = checkpoint_utils.get_last_checkpoint(str(log_path))
    if found is None or found.state_path is None:
        return fail("the first run left no checkpoint to resume from")
    print(f"first run (step:NLL): {show(first)}")
    print(f"checkpoint found: {found.name} (batch {found.batch}) {found.state_path}")

    asyncio.run(train.main(config(log_path, data, -1)))  # the same config, without the crash
    second = nll_rows(log_path)[len(first) :]
    print(f"second run (step:NLL): {show(second)}")
    if not second or second[0][0] != found.batch:
        fail(f"the second run began at {second[:1]}, the checkpoint says batch {found.batch}")
    if not second[0][1] < 0.5 * first[0][1]:
        fail(
            f"the second run's first NLL {second[0][1]:.3f} is not from the checkpoint's weights "
            f"(the first run began at {first[0][1]:.3f})"
        )
    final = checkpoints(log_path)[-1]
    print(f"final checkpoint: {final}")

    rest = tinker.RestClient()
    run = rest.get_training_run_by_tinker_path(found.state_path).result()
    print(
        f"training run {run.training_run_id}: base {run.base_model}, lora rank {run.lora_rank}, "
        f"metadata {run.user_metadata}"
    )
    if (run.user_metadata or {}).get(checkpoint_utils.RENDERER_NAME_METADATA_KEY) != RENDERER:
        fail(f"the training run does not carry the renderer name: {run.user_metadata}")
    listed = rest.list_checkpoints(run.training_run_id).result().checkpoints
    print("its checkpoints:", " ".join(f"{c.checkpoint_id} ({c.checkpoint_type})" for c in listed))
    if found.state_path not in {c.tinker_path for c in listed}:
        fail(f"{found.state_path} is not among the run's checkpoints")
    info = rest.get_weights_info_by_tinker_path(found.state_path).result()
    print(f"weights info: base {info.base_model}, lora rank {info.lora_rank}")

    # The cookbook's download of a training checkpoint: a run from the checkpoint, an age-encrypted
    # external export, its signed URLs, decryption here, and the export deleted after.
    adapter = Path(weights.download(tinker_path=found.state_path, output_dir=str(log_dir / "adapter")))
    files = sorted(p.name for p in adapter.iterdir())
    peft_config = json.loads((adapter / "adapter_config.json").read_text())
    base, rank = peft_config["base_model_name_or_path"], peft_config["r"]
    print(f"downloaded: {' '.join(files)}; base {base}, rank {rank}")
    if "adapter_model.safetensors" not in files or rank != info.lora_rank:
        fail(f"the download is not the checkpoint's peft adapter: {files}, {peft_config}")
    print("OK resume")


if __name__ == "__main__":
    run_script(main)
