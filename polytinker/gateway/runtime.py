"""A local runtime with its HTTP front door: the scheduler, engines and learners of
:class:`~polytinker.scheduler.service.runtime.LocalRuntime`, and a :class:`~polytinker.gateway.app.Gateway`
on a thread of this process serving the Tinker API and OpenAI's at ``/v1`` at ``[http] address``.
The gateway is a client of the scheduler like any other; ``polytinker serve --http`` runs one of
these, and a script does the same with::

    with HttpRuntime(RuntimeConfig(http=HttpConfig(address="127.0.0.1:0"))) as runtime:
        print(runtime.http_url)  # http://127.0.0.1:PORT

A plain ``LocalRuntime`` refuses an ``[http] address``: the scheduler's package does not start
its own clients."""

from __future__ import annotations

from polytinker.gateway.app import Gateway
from polytinker.gateway.hub_tokenizer import tokenizer_id
from polytinker.scheduler.service.runtime import LocalRuntime


class HttpRuntime(LocalRuntime):
    """A :class:`LocalRuntime` and, when ``config.http.address`` is set, its HTTP gateway."""

    serves_http = True
    gateway: Gateway | None = None

    def start(self) -> HttpRuntime:
        super().start()
        cfg = self.config
        if cfg.http.address and self.gateway is None:
            try:
                tokenizer = cfg.http.tokenizer_id or tokenizer_id(
                    cfg.model
                )  # the hub id, its tokenizer in the hub cache
                gateway = Gateway(
                    self.local_address,
                    cfg.state_path,
                    cfg.http,
                    base_models=(cfg.model,),
                    tokenizer_ids={cfg.model: tokenizer},
                )
                self.gateway = gateway.start()
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """The gateway first (no new calls), then the runtime."""
        gateway, self.gateway = self.gateway, None
        if gateway is not None:
            gateway.stop()
        super().stop()

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the HTTP front door ("" when it is off)."""
        return self.gateway.url if self.gateway is not None else ""

    def __enter__(self) -> HttpRuntime:
        return self.start()


__all__ = ["HttpRuntime"]
