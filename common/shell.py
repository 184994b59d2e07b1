"""The process shell every ``cache-indexer`` worker runs in; a worker's ``main`` is only wiring.

:func:`run_worker` does, in order: parse the command line (``--config``, ``--metrics-port``
and the worker's own flags), load and validate the config file (every problem listed, exit
status 2), translate it into the worker's settings (:mod:`common.settings`), configure
logging, install the signal handlers (first SIGTERM/SIGINT sets ``stop``, a second one
exits at once), serve ``/metrics``, ``/healthz`` and ``/readyz`` on the metrics port when
one is set, and then call the worker with a :class:`Process`. Everything opened on the
way — the metrics server, the Redis client (:meth:`Process.redis`, the one place
:func:`common.redis_client.connect` is called by a worker), whatever the worker hands to
:meth:`Process.on_exit` — is closed in ``finally``, in reverse order.

Exit status: 0 after a requested stop (or ``--help``), 2 for a bad command line or config
(also a :class:`~common.errors.ConfigError` raised while the worker sets itself up). The
API, whose process is gunicorn's arbiter, uses only :func:`parser` and :func:`start`.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from common import logs
from common.config import Config, config_path_from, load_config
from common.errors import ConfigError
from common.health import Health
from common.lifecycle import install_signal_handlers
from common.redis_client import Client, connect, watch_role
from common.settings import ProcessSettings

if TYPE_CHECKING:  # imported when a worker runs: the API's master must not load
    from common.metrics import Registry  # prometheus_client before it sets its multiproc dir

S = TypeVar("S")

REDIS_RETRIES = 3
"""Quick retries of a failed Redis command on a fresh connection (the workers' loops have
their own outer backoff for longer outages)."""


class ExitStatus(Exception):
    """The process must exit now with ``code`` (what it had to say is printed already)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def parser(prog: str, description: str, *, metrics_port: bool = True) -> argparse.ArgumentParser:
    """An argument parser with the flags every process shares."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", help="config file (default: $CACHE_INDEXER_CONFIG)")
    if metrics_port:
        p.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve /metrics, /healthz and /readyz here (0 = off; default: metrics.port)",
        )
    return p


def config_failure(prog: str, exc: ConfigError) -> ExitStatus:
    """Print a config (or command-line) error; the exit status to raise or return."""
    print(f"{prog}: {exc}", file=sys.stderr)
    return ExitStatus(2)


@dataclass(frozen=True)
class Startup(Generic[S]):
    """A validated start: the parsed flags, the config path and the translated settings."""

    args: argparse.Namespace
    config_path: str | None
    process: ProcessSettings
    settings: S


def start(
    p: argparse.ArgumentParser,
    argv: list[str],
    translate: Callable[[Config, argparse.Namespace], S],
) -> Startup[S]:
    """Parse ``argv``, load and validate the config, translate it, configure logging.

    ``translate`` builds the process's own settings (and checks its flags); a
    :class:`ConfigError` from it or from the file is printed and raises ``ExitStatus(2)``,
    as does a bad command line; ``--help`` raises ``ExitStatus(0)``."""
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the usage or the help already
        raise ExitStatus(0 if exc.code == 0 else 2) from None
    path = config_path_from(args.config)
    try:
        cfg = load_config(path)
        settings = translate(cfg, args)
    except ConfigError as exc:
        raise config_failure(p.prog, exc) from None
    process = ProcessSettings.from_config(cfg, getattr(args, "metrics_port", None))
    logs.configure(process.log_level, process.log_format)
    return Startup(args, path, process, settings)


class Process(Generic[S]):
    """What the shell hands a running worker: its settings and the process's shared parts."""

    def __init__(self, startup: Startup[S], stack: ExitStack) -> None:
        self.args = startup.args
        self.config_path = startup.config_path
        self.settings: S = startup.settings
        from common.metrics import Registry

        self.stop = threading.Event()
        self.registry: Registry = Registry()
        self.health = Health(startup.process.liveness_timeout)
        self._redis_cfg = startup.process.redis
        self._stack = stack
        self._client: Client | None = None

    def redis(self) -> Client:
        """The process's pooled Redis client (made on first use, closed at exit); its role is
        watched for readiness (:func:`common.redis_client.watch_role`)."""
        if self._client is None:
            self._client = connect(self._redis_cfg, retries=REDIS_RETRIES)
            self._stack.callback(self._client.close)
            watch_role(self._client, self.health, self.stop)
        return self._client

    def on_exit(self, close: Callable[[], object]) -> None:
        """Call ``close`` when the process ends (before what was opened earlier)."""
        self._stack.callback(close)


def run_worker(
    prog: str,
    description: str,
    argv: list[str],
    *,
    translate: Callable[[Config, argparse.Namespace], S],
    run: Callable[[Process[S]], None],
    arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Run one worker process inside the shell (see the module docstring); its exit status."""
    p = parser(prog, description)
    if arguments is not None:
        arguments(p)
    try:
        startup = start(p, argv, translate)
    except ExitStatus as exc:
        return exc.code
    from common.metrics import serve

    with ExitStack() as stack:
        proc = Process(startup, stack)
        install_signal_handlers(proc.stop)
        if startup.process.metrics_port:
            server = serve(
                proc.registry,
                startup.process.metrics_addr,
                startup.process.metrics_port,
                proc.health,
            )
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
        try:
            run(proc)
        except ConfigError as exc:  # found while setting up, e.g. an unusable kubeconfig
            return config_failure(prog, exc).code
    return 0
