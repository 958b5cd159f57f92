"""A data-parallel learner group: K processes, one model replica each; rank 0 leads.

Rank 0 holds a :class:`LearnerGroup`, which has a learner's methods. Each call that touches the
model is broadcast to every rank over a gloo control group (msgpack bytes, never pickle); every
rank runs it on its contiguous shard of the datums; ``optim_step`` sums the gradients over the
ranks before stepping, so K ranks make the same update as one process on the whole batch (losses
are sums; see ``losses``). Results come back to rank 0 with an all-gather. A full-parameter group
is sharded with FSDP2 (``sharding``): its ranks run each call's passes in lockstep, and
``save_state`` is a call of every rank.

Two ways to start one:

- :meth:`LearnerGroup.start` (the runtime): the calling process becomes rank 0 and starts K-1
  followers as supervised process actors (``follower.LearnerFollower``, ``FollowerSet``), or, in a
  Ray actor, as Ray actors in the other bundles of its placement group, on other nodes where
  they do not fit on its own (``ray_followers.RayFollowerSet``). They die
  with rank 0; when one exits, the group is broken for good (a process group cannot take a rank
  back): rank 0's calls answer ``WorkerFailed`` from then on, and ``on_broken`` tells the group's
  owner, whose process ends so that its own supervisor starts the group anew.
- ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``):
  every rank calls :func:`run_rank`, which returns the group on rank 0 and serves until
  ``close()`` on the others.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from polytinker.engine.device import rank_device
from polytinker.engine.learner import make_learner
from polytinker.engine.learner._base import ForwardBackwardResult, filler_datum
from polytinker.engine.learner.checks import check_data
from polytinker.engine.learner.config import AdamParams, LearnerConfig, LossConfig
from polytinker.engine.learner.distributed import DistInfo, free_port, init_distributed
from polytinker.engine.learner.follower import Followers, FollowerSet, FollowersKind
from polytinker.engine.learner.full_param import FullParamLearner
from polytinker.engine.learner.multi_adapter import MultiAdapterLearner
from polytinker.engine.models import DType, ModelConfig, load_model
from polytinker.engine.types import AdapterName, AdapterRef, Datum, LoraConfig, LossFnName
from polytinker.errors import ConfigError, WorkerFailed

log = logging.getLogger(__name__)
AnyLearner = MultiAdapterLearner | FullParamLearner
JOIN_TIMEOUT_S = 300.0


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous, as even as possible; the first ``n % world_size`` ranks take one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _datum_to_wire(d: Datum) -> list[Any]:
    return [d.input_tokens, d.target_tokens_T, d.weights_T, d.advantages_T, d.sampling_logprobs_T]


def _send(obj: Any, group: Any) -> None:
    payload = msgpack.packb(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=group)


def _recv(group: Any) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    return msgpack.unpackb(buf.numpy().tobytes())


def _gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    payload = msgpack.packb(obj)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    return [msgpack.unpackb(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


def _execute(learner: AnyLearner, info: DistInfo, group: Any, op: str, args: dict[str, Any]) -> Any:
    """Run one broadcast call on this rank; collective, so every rank calls it with the same ``op``."""
    if op in ("forward", "forward_backward"):
        data = [Datum(*row) for row in args["data"]]
        start, end = shard_bounds(len(data), info.rank, info.world_size)
        mine: dict[str, Any] = {"logprobs": [], "loss": 0.0, "metrics": {}}
        if op == "forward_backward" and end <= start and not _sharded(learner):
            _abstain(learner)
        elif end > start or _sharded(learner):  # a sharded rank without datums still runs its passes
            with _lockstep(learner, info, data):
                if op == "forward" and args.get("loss_fn"):  # Tinker's forward with a loss
                    result = learner.forward_loss(
                        data[start:end], args["loss_fn"], args["adapter"], args["loss_fn_config"]
                    )
                    mine = _part(result) if end > start else mine
                elif op == "forward":
                    mine["logprobs"] = learner.forward(data[start:end], args["adapter"])
                else:
                    result = learner.forward_backward(
                        data[start:end], args["loss_fn"], args["adapter"], args["loss_fn_config"]
                    )
                    mine = _part(result) if end > start else mine
        return _gather(mine, group)
    if op == "forward_backward_many":
        assert isinstance(learner, MultiAdapterLearner)
        shards = {}
        for name, rows in args["data"].items():  # each adapter's datums split over the ranks
            start, end = shard_bounds(len(rows), info.rank, info.world_size)
            if end > start:
                shards[name] = [Datum(*row) for row in rows[start:end]]
        if shards:
            out = learner.forward_backward_many(shards, args["loss_fn"], args["loss_fn_config"])
        else:
            out = _abstain(learner)
        empty = {"logprobs": [], "loss": 0.0, "metrics": {}}
        parts = {name: _part(out[name]) if name in out else empty for name in args["data"]}
        return _gather(parts, group)
    if op == "optim_step":
        return learner.optim_step(AdamParams(**args["adam"]), args["adapter"])
    if op == "discard_gradient":
        return learner.discard_gradient(args["adapter"])
    if op == "add_adapter":
        assert isinstance(learner, MultiAdapterLearner)
        lora = LoraConfig(**{**args["lora"], "target_modules": tuple(args["lora"]["target_modules"])})
        return learner.add_adapter(args["name"], lora, args["seed"])
    if op == "remove_adapter":
        assert isinstance(learner, MultiAdapterLearner)
        return learner.remove_adapter(args["name"])
    if op == "save_state":  # sharded: every rank gathers, rank 0 writes
        return learner.save_state(args["path"], args["adapter"])
    if op == "load_state":
        return learner.load_state(args["path"], args["adapter"], optimizer=args.get("optimizer", True))
    raise ConfigError(f"unknown learner group op {op!r}")


def _abstain(learner: AnyLearner) -> dict[str, Any]:
    """A rank with no datums in a training call still votes on its outcome (``Learner.vote``)."""
    verdict = learner.vote("")
    if verdict:
        raise ConfigError(verdict)
    return {}


def _vote(problem: str, group: Any) -> str:
    """The first problem any rank had in a training call ('' for none), the same on every rank."""
    for rank, p in enumerate(_gather(problem, group)):
        if p:
            return p if rank == 0 else f"{p} (rank {rank})"
    return ""


def _voting(learner: AnyLearner, group: Any) -> None:
    """Make ``learner``'s training calls keep or drop their gradient as all the group's ranks do."""
    learner.vote = functools.partial(_vote, group=group)


def _sharded(learner: AnyLearner) -> bool:
    return isinstance(learner, FullParamLearner) and learner.sharded


def _lockstep(learner: AnyLearner, info: DistInfo, data: list[Datum]) -> contextlib.AbstractContextManager[None]:
    """For a sharded learner: every rank runs as many micro-batch passes as the rank with the
    most (``Learner.lockstep``); a replicated one runs its own shard as it is."""
    if not _sharded(learner) or not data:
        return contextlib.nullcontext()
    spans = [shard_bounds(len(data), r, info.world_size) for r in range(info.world_size)]
    inputs = [list(d.input_tokens) for d in data]
    passes = max(len(learner.micro_batch_plan(inputs[start:end])) for start, end in spans)
    return learner.lockstep(passes, filler_datum(data[0]))


def _part(r: ForwardBackwardResult) -> dict[str, Any]:
    return {"logprobs": r.logprobs, "loss": r.loss, "metrics": r.metrics}


def _merge(parts: list[dict[str, Any]]) -> ForwardBackwardResult:
    """One result from the ranks' shard results: sums add; per-token means re-weight by tokens."""
    live = [p for p in parts if p["metrics"]]
    tokens = sum(p["metrics"]["loss/tokens"] for p in live)
    metrics: dict[str, float] = {}
    for key in live[0]["metrics"] if live else []:
        if key in ("loss/sum", "loss/tokens"):
            metrics[key] = sum(p["metrics"][key] for p in live)
        elif key == "kl/coef":
            metrics[key] = live[0]["metrics"][key]
        else:
            metrics[key] = sum(p["metrics"][key] * p["metrics"]["loss/tokens"] for p in live) / max(tokens, 1.0)
    logprobs = [row for p in parts for row in p["logprobs"]]
    return ForwardBackwardResult(sum(p["loss"] for p in parts), logprobs, metrics)


class LearnerGroup:
    """Rank 0's handle on K learner replicas; in-process calls, collective underneath."""

    def __init__(self, learner: AnyLearner, info: DistInfo, followers: Followers | None = None):
        self.learner, self.info, self.followers = learner, info, followers
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if self._group is not None:
            _voting(learner, self._group)

    @classmethod
    def start(
        cls,
        model_spec: str,
        world_size: int,
        config: LearnerConfig | None = None,
        device: str = "cpu",
        dtype: DType = "float32",
        *,
        name: str = "learner",
        on_broken: Callable[[str], None] | None = None,
        followers: FollowersKind = "local",
    ) -> LearnerGroup:
        """Make this process rank 0 of a fresh group of ``world_size`` and start the followers
        (named ``<name>-rank<r>``): ``followers = "local"``, process actors on this machine;
        ``"ray"``, Ray actors in the other bundles of this Ray actor's placement group, on
        whichever nodes hold them (``ray_followers``). ``device``: rank 0's (``cuda:N``: locally,
        rank r on ``cuda:N+r``; on Ray, each rank on its own bundle's GPU; NCCL; else the CPU,
        gloo). ``on_broken(reason)``: called (on a background thread) when a follower ends
        before ``close``."""
        if dist.is_initialized():
            raise ConfigError("this process already belongs to a torch.distributed group; start the group elsewhere")
        config = config or LearnerConfig()
        own_device = followers == "ray"
        addr = f"tcp://{_rendezvous_host(followers)}:{free_port()}"
        args = (addr, model_spec, asdict(config), device, dtype, torch.get_num_threads(), own_device)
        ranks: Followers
        if followers == "ray":
            from polytinker.engine.learner.ray_followers import RayFollowerSet  # ray: only in a Ray actor

            ranks = RayFollowerSet(name, world_size, args, on_broken)
        else:
            ranks = FollowerSet(name, world_size, args, on_broken)
        try:
            learner, info = _build(0, world_size, addr, model_spec, config, device, dtype, own_device)
        except BaseException:
            ranks.close()
            raise
        return cls(learner, info, ranks)

    # -- the learner API ------------------------------------------------------------------------
    def _call(self, op: str, **args: Any) -> Any:
        if self._group is None:
            return None
        if self.followers is not None:  # None: ranks started by a launcher (torchrun), which watches them
            self.followers.check()
        try:
            _send({"op": op, **args}, self._group)
            return _execute(self.learner, self.info, self._group, op, args)
        except Exception as exc:
            if self.followers is None or not self.followers.died_under(exc):
                raise
            log.warning("learner group op %r failed as a rank died: %s", op, exc)
            raise WorkerFailed(self.followers.broken) from None  # the collective's error names torch's source files

    def _check(
        self,
        adapter: AdapterName | None,
        data: list[Datum] | None = None,
        loss_fn: str | None = None,
        *,
        trains: bool = True,
        where: str = "",
    ) -> None:
        """Raise here, before broadcasting, what every rank would raise, so followers stay in step:
        a rank that failed its shard's check while the others ran their passes would leave them
        waiting in a collective."""
        if trains or adapter is not None:
            self.learner._slot(adapter)
        if data is not None:
            check_data(data, self.learner.vocab_size, loss_fn, where=where)

    def add_adapter(self, name: AdapterName, lora: LoraConfig | None = None, seed: int = 0) -> AdapterRef:
        lora = lora or LoraConfig()
        if self._group is None:
            assert isinstance(self.learner, MultiAdapterLearner)
            return self.learner.add_adapter(name, lora, seed)
        ref: AdapterRef = self._call("add_adapter", name=name, lora=asdict(lora), seed=seed)
        return ref

    def remove_adapter(self, name: AdapterName) -> None:
        if self._group is None:
            assert isinstance(self.learner, MultiAdapterLearner)
            self.learner.remove_adapter(name)
        else:
            self._call("remove_adapter", name=name)

    def adapters(self) -> list[AdapterRef]:
        if isinstance(self.learner, MultiAdapterLearner):
            return self.learner.adapters()
        return [self.learner.version()]

    def forward(self, data: list[Datum], adapter: AdapterName | None = None) -> list[list[float]]:
        if self._group is None:
            return self.learner.forward(data, adapter)
        self._check(adapter, data, trains=False)
        parts = self._call("forward", data=[_datum_to_wire(d) for d in data], adapter=adapter)
        return [row for p in parts for row in p["logprobs"]]

    def forward_loss(
        self,
        data: list[Datum],
        loss_fn: LossFnName,
        adapter: AdapterName | None = None,
        loss_fn_config: dict[str, float] | None = None,
    ) -> ForwardBackwardResult:
        """``forward`` with the loss ``forward_backward`` would compute, and no gradient."""
        if self._group is None:
            return self.learner.forward_loss(data, loss_fn, adapter, loss_fn_config)
        return self._scored("forward", data, loss_fn, adapter, loss_fn_config)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: LossFnName,
        adapter: AdapterName | None = None,
        loss_fn_config: dict[str, float] | None = None,
    ) -> ForwardBackwardResult:
        if self._group is None:
            return self.learner.forward_backward(data, loss_fn, adapter, loss_fn_config)
        return self._scored("forward_backward", data, loss_fn, adapter, loss_fn_config)

    def _scored(
        self,
        op: str,
        data: list[Datum],
        loss_fn: LossFnName,
        adapter: AdapterName | None,
        loss_fn_config: dict[str, float] | None,
    ) -> ForwardBackwardResult:
        """A loss over ``data`` on every rank (``op``: with its gradient or without), merged."""
        self._check(adapter, data, loss_fn, trains=op == "forward_backward")
        LossConfig.from_mapping(loss_fn_config)
        wire = [_datum_to_wire(d) for d in data]
        return _merge(self._call(op, data=wire, loss_fn=loss_fn, adapter=adapter, loss_fn_config=loss_fn_config))

    def forward_backward_many(
        self,
        data_by_adapter: dict[AdapterName, list[Datum]],
        loss_fn: LossFnName,
        loss_fn_config: dict[str, float] | None = None,
    ) -> dict[AdapterName, ForwardBackwardResult]:
        """Several adapters' ``forward_backward`` in shared passes (each rank on its shard of each)."""
        assert isinstance(self.learner, MultiAdapterLearner)
        if self._group is None:
            return self.learner.forward_backward_many(data_by_adapter, loss_fn, loss_fn_config)
        for name, data in data_by_adapter.items():
            self._check(name, data, loss_fn, where=f"adapter {name!r}")
        LossConfig.from_mapping(loss_fn_config)
        wire = {name: [_datum_to_wire(d) for d in data] for name, data in data_by_adapter.items()}
        ranks = self._call("forward_backward_many", data=wire, loss_fn=loss_fn, loss_fn_config=loss_fn_config)
        return {name: _merge([rank[name] for rank in ranks]) for name in data_by_adapter}

    def optim_step(self, adam_params: AdamParams, adapter: AdapterName | None = None) -> AdapterRef:
        if self._group is None:
            return self.learner.optim_step(adam_params, adapter)
        self._check(adapter)
        ref: AdapterRef = self._call("optim_step", adam=asdict(adam_params), adapter=adapter)
        return ref

    def discard_gradient(self, adapter: AdapterName | None = None) -> None:
        if self._group is None:
            self.learner.discard_gradient(adapter)
        else:
            self._check(adapter)
            self._call("discard_gradient", adapter=adapter)

    def load_state(
        self, path: str | os.PathLike[str], adapter: AdapterName | None = None, *, optimizer: bool = True
    ) -> AdapterRef:
        if self._group is None:
            return self.learner.load_state(path, adapter, optimizer=optimizer)
        ref: AdapterRef = self._call("load_state", path=str(path), adapter=adapter, optimizer=optimizer)
        return ref

    def save_state(self, path: str | os.PathLike[str], adapter: AdapterName | None = None) -> Any:
        if self._group is not None and _sharded(self.learner):
            self._check(adapter)
            return self._call("save_state", path=str(path), adapter=adapter)
        return self.learner.save_state(path, adapter)  # replicas hold the same state: rank 0 writes it

    def export_adapter(self, name: AdapterName) -> Any:
        assert isinstance(self.learner, MultiAdapterLearner)
        return self.learner.export_adapter(name)

    def close(self) -> None:
        """Stop the followers and leave the group."""
        if self._group is not None and not (self.followers and self.followers.broken):
            try:
                _send({"op": "stop"}, self._group)
            except Exception as exc:  # a rank died as the group closed: no one is left to stop
                log.warning("learner group: the stop did not reach every rank: %s", exc)
        self._group = None
        if self.followers is not None:
            self.followers.close()  # each leaves the process group and exits; one that does not is killed
        if dist.is_initialized():
            dist.destroy_process_group()


def _build(
    rank: int,
    world: int,
    addr: str | None,
    model_spec: str,
    config: LearnerConfig,
    device: str,
    dtype: DType = "float32",
    own_device: bool = False,
) -> tuple[AnyLearner, DistInfo]:
    if addr is not None:
        # own_device: the rank sees its own GPUs only (a Ray bundle's), and takes the first.
        dev = torch.device(device) if own_device else rank_device(torch.device(device), rank)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # A bounded wait: a follower that fails to start makes rank 0 raise instead of hanging.
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        dist.init_process_group(backend, init_method=addr, rank=rank, world_size=world, timeout=timeout)
        info = DistInfo(rank, world, rank, dev)
    else:
        info = init_distributed(device=device)
    model, tokenizer = load_model(model_spec, ModelConfig(dtype=dtype))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return make_learner(model, config, info, pad_token_id=int(pad)), info


def _rendezvous_host(followers: FollowersKind) -> str:
    """Where rank 0 listens for its followers: this machine only, or its Ray node's IP (the
    followers may run on other nodes)."""
    if followers == "ray":
        from polytinker.engine.learner.ray_followers import node_ip  # ray: only in a Ray actor

        return node_ip()
    return "127.0.0.1"


def serve(learner: AnyLearner, info: DistInfo, group: Any) -> None:
    """A follower's loop: run each broadcast call until rank 0 says stop."""
    _voting(learner, group)
    while True:
        msg = _recv(group)
        op = msg.pop("op")
        if op == "stop":
            return
        try:
            _execute(learner, info, group, op, msg)
        except Exception:
            # Rank 0 raised the same error to its caller (errors before any collective are the
            # same on every rank); keep serving so the group stays usable.
            log.exception("rank %d: learner group op %r failed", info.rank, op)


def follow(
    rank: int,
    world: int,
    addr: str,
    model_spec: str,
    config: dict[str, Any],
    device: str,
    dtype: DType,
    threads: int,
    own_device: bool = False,
) -> None:
    """A follower's life (``LearnerFollower``, ``RayFollower``): build the replica, serve until
    rank 0 says stop."""
    torch.set_num_threads(threads)  # as many as rank 0 uses: replicas share the machine evenly
    learner, info = _build(rank, world, addr, model_spec, LearnerConfig(**config), device, dtype, own_device)
    try:
        serve(learner, info, dist.new_group(backend="gloo"))
    finally:
        dist.destroy_process_group()


def run_rank(model_spec: str, config: LearnerConfig | None = None, device: str = "cpu") -> LearnerGroup | None:
    """Under ``torchrun``: rank 0 gets the group handle; other ranks serve and return None at close."""
    learner, info = _build(0, 1, None, model_spec, config or LearnerConfig(), device)
    if info.rank == 0:
        return LearnerGroup(learner, info)
    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    serve(learner, info, group)
    dist.destroy_process_group()
    return None


__all__ = ["LearnerGroup", "follow", "run_rank", "serve", "shard_bounds"]
