"""Remote envs over ZeroMQ: ``EnvServer`` serves registered envs; ``RemoteEnv`` plays them.

The wire protocol is in docs/remote-envs.md (env messages) on top of docs/wire-protocol.md
(the RPC envelope).
"""

from polytinker.envs.remote.client import RemoteAECEnv, RemoteEnv, RemoteParallelEnv, RemoteScriptedPolicy
from polytinker.envs.remote.server import EnvServer

__all__ = ["EnvServer", "RemoteAECEnv", "RemoteEnv", "RemoteParallelEnv", "RemoteScriptedPolicy"]
