"""The cluster examples (examples/cluster/, docs/cluster.md) stay valid with the code as it is.

Every ``polytinker ...`` command line of the sbatch script and of the Kubernetes manifests is taken
out of its file, its shell or Kubernetes variables replaced by sample values, and parsed by the real
``polytinker`` argument parser: a flag the CLI no longer has fails here. Worker command lines also
go through the checks ``polytinker worker`` runs before it loads a model, and the engine ids the
launchers produce must be exactly the remote engines that runtime.toml declares. The sbatch
script passes ``bash -n``; the manifests load as YAML. Negative controls show that each check can
fail: a misspelt flag, a shell syntax error and an undeclared id are refused.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from polytinker.cli import build_parser
from polytinker.scheduler._cli import _check_worker_addresses
from polytinker.scheduler.service.config import RuntimeConfig

pytestmark = pytest.mark.timeout(60)

CLUSTER = Path(__file__).resolve().parent.parent / "examples" / "cluster"
SBATCH = CLUSTER / "slurm.sbatch"
MANIFESTS = CLUSTER / "kubernetes.yaml"
RUNTIME = CLUSTER / "runtime.toml"

# Sample values for every variable the examples' polytinker command lines use. A new variable
# there fails the test until it is given a value here (so none is parsed unexpanded).
SAMPLE = {
    "RUN": "/shared/project/polytinker-42",
    "STATE": "/tmp/polytinker-42",
    "HEAD": "node-0",
    "PORT": "7000",
    "ip": "10.0.0.2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "GPUS_PER_NODE": "4",
    "POLYTINKER_WORKER_TOKEN": "a-sample-worker-token-0123456789",
    "ENGINE_INDEX": "0",
    "POD_IP": "10.0.0.3",
}
_SHELL_OPERATORS = {"&", "&&", ";", "|", "||", ">", ">>", "<", "(", ")"}


def expand(text: str, values: dict[str, str]) -> str:
    """``text`` with ``$((...))``, ``$(NAME)`` (Kubernetes), ``${NAME}`` and ``$NAME`` replaced."""
    text = re.sub(r"\$\(\(([^()]*)\)\)", lambda m: str(_arith(m.group(1), values)), text)

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise AssertionError(f"${name} in a polytinker command line: give it a sample value in SAMPLE")
        return values[name]

    return re.sub(r"\$\(([A-Za-z_]\w*)\)|\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)", value, text)


def _arith(expr: str, values: dict[str, str]) -> int:
    """A shell ``$((a + B))`` of numbers and variables."""
    terms = [t.strip() for t in expr.split("+")]
    return sum(int(values.get(t.lstrip("$"), t)) for t in terms)


def shell_commands(script: str, values: dict[str, str]) -> list[list[str]]:
    """The argv (after ``polytinker``) of every polytinker command in a shell script."""
    logical = script.replace("\\\n", " ").splitlines()
    found = []
    for line in logical:
        if line.lstrip().startswith("#") or not re.search(r"(^|[\s;&|])polytinker\s", line):
            continue
        lexer = shlex.shlex(expand(line, values), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        start = tokens.index("polytinker") + 1
        end = next((i for i in range(start, len(tokens)) if tokens[i] in _SHELL_OPERATORS), len(tokens))
        found.append(tokens[start:end])
    return found


def manifest_commands(docs: list[dict[str, Any]], values: dict[str, str]) -> list[list[str]]:
    """The argv of every polytinker command in the manifests' containers: a command list that
    starts with ``polytinker`` (Kubernetes expands ``$(NAME)``), or a shell script run by ``sh -c``."""
    found = []
    for container in containers(docs):
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv[:1] == ["polytinker"]:
            found.append([expand(a, values) for a in argv[1:]])
        elif argv[:2] == ["/bin/sh", "-c"]:
            found += shell_commands(argv[2], values)
    return found


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for d in docs if d["kind"] in ("StatefulSet", "Job") for c in d["spec"]["template"]["spec"]["containers"]]


def strict_parser() -> argparse.ArgumentParser:
    """The real ``polytinker`` parser, each (sub)parser without abbreviations: a flag renamed to a
    longer name would otherwise still accept the old one as its prefix."""
    parser = build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()
    return parser


def parse(argv: list[str]) -> Any:
    """``polytinker ARGV`` through the real parser; a refused line fails the test with its text."""
    try:
        return strict_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`polytinker {shlex.join(argv)}` is refused by the CLI (exit {exc.code})") from None


def check_command(argv: list[str]) -> Any:
    args = parse(argv)
    if args.command == "worker":
        _check_worker_addresses(args)  # what `polytinker worker` refuses before it loads a model
    return args


def load_manifests() -> list[dict[str, Any]]:
    with MANIFESTS.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def remote_engines() -> set[str]:
    return {e.engine_id for e in RuntimeConfig.from_toml(RUNTIME).engines if not e.local}


def sbatch_setting(name: str, text: str) -> int:
    m = re.search(rf"^(?:#SBATCH --{name}=|{name}=)(\d+)", text, re.M)
    assert m, f"{name} not found in {SBATCH.name}"
    return int(m.group(1))


def test_sbatch_commands_parse_with_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    commands = shell_commands(SBATCH.read_text(), SAMPLE)
    assert [c[0] for c in commands] == ["keys", "keys", "serve", "worker"], commands
    for argv in commands:
        check_command(argv)
    capsys.readouterr()  # argparse's messages of a refusal, if any, are in the assertion instead


def test_manifest_commands_parse_with_the_cli() -> None:
    commands = manifest_commands(load_manifests(), SAMPLE)
    assert [c[0] for c in commands] == ["serve", "worker"], commands
    for argv in commands:
        check_command(argv)


def test_sbatch_passes_bash_syntax_check() -> None:
    run = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=20)
    assert run.returncode == 0, run.stderr


def test_scheduler_pod_script_passes_sh_syntax_check() -> None:
    (scheduler,) = [c for c in containers(load_manifests()) if c["command"][:2] == ["/bin/sh", "-c"]]
    run = subprocess.run(["sh", "-n", "-c", scheduler["command"][2]], capture_output=True, text=True, timeout=20)
    assert run.returncode == 0, run.stderr


def test_launched_engine_ids_are_the_declared_remote_engines() -> None:
    text = SBATCH.read_text()
    tasks = (sbatch_setting("nodes", text) - 1) * sbatch_setting("ENGINES_PER_NODE", text)
    slurm_ids = set()
    for rank in range(tasks):
        (worker,) = [c for c in shell_commands(text, {**SAMPLE, "SLURM_PROCID": str(rank)}) if c[0] == "worker"]
        slurm_ids.add(parse(worker).id)
    assert slurm_ids == remote_engines()

    docs = load_manifests()
    (job,) = [d for d in docs if d["kind"] == "Job"]
    assert job["spec"]["completionMode"] == "Indexed"
    k8s_ids = set()
    for index in range(job["spec"]["completions"]):
        (worker,) = [c for c in manifest_commands(docs, {**SAMPLE, "ENGINE_INDEX": str(index)}) if c[0] == "worker"]
        k8s_ids.add(parse(worker).id)
    assert k8s_ids == remote_engines()


def test_learner_gpus_match_the_config() -> None:
    (learner,) = RuntimeConfig.from_toml(RUNTIME).learners
    text = SBATCH.read_text()
    assert sbatch_setting("gpus-per-node", text) == sbatch_setting("GPUS_PER_NODE", text) == learner.world_size
    (sts,) = [d for d in load_manifests() if d["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == learner.world_size


def test_workers_dial_the_headless_service() -> None:
    docs = load_manifests()
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    port = service["spec"]["ports"][0]["port"]
    (worker,) = [c for c in manifest_commands(docs, SAMPLE) if c[0] == "worker"]
    assert parse(worker).scheduler == f"tcp://{service['metadata']['name']}:{port}"
    assert RuntimeConfig.from_toml(RUNTIME).address.endswith(f":{port}")


def test_config_with_the_token_on_top_loads(tmp_path: Path) -> None:
    """What slurm.sbatch and the scheduler pod serve: runtime.toml with ``worker_token`` first."""
    rendered = tmp_path / "runtime.toml"
    rendered.write_text(f'worker_token = "{SAMPLE["POLYTINKER_WORKER_TOKEN"]}"\n' + RUNTIME.read_text())
    cfg = RuntimeConfig.from_toml(rendered)
    assert cfg.worker_token == SAMPLE["POLYTINKER_WORKER_TOKEN"]
    assert cfg.curve_secret_file and cfg.curve_clients_dir  # a public address: Curve is on
    assert [g.local for g in cfg.learners] == [True]


# --- negative controls: each check above can fail --------------------------------------------


def test_a_misspelt_flag_is_refused() -> None:
    (worker,) = [c for c in shell_commands(SBATCH.read_text(), SAMPLE) if c[0] == "worker"]
    wrong = ["--bind-address" if a == "--bind" else a for a in worker]
    assert wrong != worker
    with pytest.raises(AssertionError, match="refused by the CLI"):
        parse(wrong)


def test_an_abbreviated_flag_is_refused() -> None:
    (worker,) = [c for c in shell_commands(SBATCH.read_text(), SAMPLE) if c[0] == "worker"]
    assert "--state-dir" in worker
    with pytest.raises(AssertionError, match="refused by the CLI"):
        parse(["--state" if a == "--state-dir" else a for a in worker])


def test_a_worker_binding_no_address_is_refused() -> None:
    from polytinker.errors import ConfigError

    (worker,) = [c for c in manifest_commands(load_manifests(), SAMPLE) if c[0] == "worker"]
    with pytest.raises(ConfigError, match="--bind"):
        check_command(["10.0.0.3:7100" if a.startswith("tcp://10.0.0.3") else a for a in worker])


def test_an_unknown_variable_is_refused() -> None:
    with pytest.raises(AssertionError, match="SAMPLE"):
        shell_commands('polytinker worker --id "engine-$NOT_GIVEN"\n', SAMPLE)


def test_bash_syntax_check_catches_an_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.sbatch"
    broken.write_text(SBATCH.read_text().replace("start_worker() {", "start_worker() (", 1))
    run = subprocess.run(["bash", "-n", str(broken)], capture_output=True, text=True, timeout=20)
    assert run.returncode != 0
