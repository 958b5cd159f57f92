import subprocess
import sys

import polytinker
from polytinker import cli
from polytinker.errors import ConfigError, NotBuiltError, PolytinkerError


def test_error_hierarchy_inherits_builtins():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, PolytinkerError)
    assert issubclass(NotBuiltError, NotImplementedError)


def test_public_surface_is_declared():
    for name in polytinker.__all__:
        assert hasattr(polytinker, name), name


def test_show_of_a_missing_run_fails_with_a_message(tmp_path, capsys):
    assert cli.main(["show", str(tmp_path / "nope")]) == 1
    assert "not a run directory" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "polytinker.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "keys" in out.stdout and "env" in out.stdout


def test_a_client_script_imports_no_torch():
    """A training script talks to the runtime through the clients and renders prompts: it needs no
    torch (about 340 MiB of resident memory) in its own process."""
    code = (
        "import sys\n"
        "from polytinker import ServiceClient\n"
        "from polytinker.agents.algorithms import make_algorithm\n"
        "from polytinker.agents.types import TurnSample\n"
        "from polytinker.engine.learner.config import AdamParams\n"
        "from polytinker.engine.types import Datum, SampleRequest\n"
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_command_into_a_closed_pipe_exits_quietly():
    """`polytinker env list | head -1` (or any command whose reader goes away): SIGPIPE's status, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "polytinker.cli", "env", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err


def test_every_error_class_lives_in_errors_and_is_exported():
    import polytinker.errors as errors

    classes = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, PolytinkerError)}
    assert classes <= set(errors.__all__), sorted(classes - set(errors.__all__))
    assert classes <= set(polytinker.__all__), sorted(classes - set(polytinker.__all__))
    for name in classes:
        assert getattr(polytinker, name) is getattr(errors, name)
    from polytinker.actors import ActorStartError
    from polytinker.envs import EnvBusy
    from polytinker.scheduler import SimulationError

    assert (ActorStartError, EnvBusy, SimulationError) == (
        errors.ActorStartError,
        errors.EnvBusy,
        errors.SimulationError,
    )
