"""The client API end to end: train a LoRA adapter for a few steps, then sample from it.

    python examples/client_quickstart.py                  # the default model (SmolLM2-135M)
    python examples/client_quickstart.py --model tiny-random --steps 2

With no scheduler address, ``ServiceClient()`` starts a local runtime for the script (a scheduler,
one engine and one learner as child processes) and stops it at the end; its state (the adapter's
saved versions) stays in ``~/.cache/polytinker/runtime/MODEL`` for later scripts. Point it at a running
``polytinker serve`` with ``ServiceClient("tcp://HOST:PORT", api_key=...)`` and nothing else changes.
"""

from __future__ import annotations

import argparse

from polytinker import AdamParams, Datum, ModelInput, SamplingClient, SamplingParams, ServiceClient


def make_datum(tokenizer: object, prompt: str, answer: str) -> Datum:
    """Cross-entropy on the answer tokens only (weights 0 on the prompt)."""
    p = tokenizer.encode(prompt)  # type: ignore[attr-defined]
    a = tokenizer.encode(answer)  # type: ignore[attr-defined]
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    with ServiceClient() as service:
        trainer = service.create_lora_training_client(args.model, rank=8)
        tokenizer = trainer.get_tokenizer()
        data = [make_datum(tokenizer, "The capital of France is", " Paris.")] * 4
        for step in range(args.steps):
            fb = trainer.forward_backward(data, "cross_entropy")  # futures: queued in order
            opt = trainer.optim_step(AdamParams(learning_rate=1e-3))
            print(f"step {step}: loss {fb.result().loss:.3f} -> adapter version {opt.result().version}")
        sampler: SamplingClient = trainer.save_weights_and_get_sampling_client("quickstart")
        prompt = ModelInput.from_ints(tokenizer.encode("The capital of France is"))
        out = sampler.sample(prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=8, temperature=0.0))
        for seq in out.result().sequences:
            print(repr(seq.text))
        trainer.finish()
        print([(j["job_id"], j["state"]) for j in service.list_jobs()])


if __name__ == "__main__":
    main()
