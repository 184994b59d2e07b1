"""``cache-indexer api --config FILE [--workers N] [--bind HOST:PORT]``: the API under gunicorn.

The config (and the block-hash settings it implies) is validated here, in the master, so a
bad file exits with status 2 before any worker starts (:func:`common.shell.start`: flags,
config, :class:`common.settings.ApiSettings`, logging). gunicorn then runs in-process
(:class:`gunicorn.app.base.BaseApplication`) and owns signals; each worker builds its app
and its Redis client after the fork (:func:`services.api.app.build_app`). SIGTERM stops
gracefully within ``http.shutdownTimeout``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from gunicorn.app.base import BaseApplication

from common import blockhash_native, shell
from common.blockhash import BlockHasher
from common.config import Config, Redis
from common.errors import ConfigError
from common.settings import ApiSettings
from services.api.app import App, build_app
from services.api.gunicorn_conf import gunicorn_settings

_PROG = "cache-indexer api"
logger = logging.getLogger(__name__)


class _Server(BaseApplication):  # type: ignore[misc]
    def __init__(self, api: ApiSettings, redis_cfg: Redis, settings: dict[str, Any]) -> None:
        self.api, self.redis_cfg, self.settings = api, redis_cfg, settings
        super().__init__()

    def do_load_config(self) -> None:
        # gunicorn's version prints and exits 1; a bad setting is a config error (exit 2).
        self.load_default_config()
        try:
            self.load_config()
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"invalid server setting: {exc}") from exc

    def load_config(self) -> None:
        for name, value in self.settings.items():
            if name in self.cfg.settings:  # older gunicorns lack a few (control_socket_*)
                self.cfg.set(name, value)

    def load(self) -> App:
        return build_app(self.api, self.redis_cfg)


@dataclass(frozen=True)
class _Setup:
    api: ApiSettings
    gunicorn: dict[str, Any]


def _settings(cfg: Config, args: argparse.Namespace) -> _Setup:
    api = ApiSettings.from_config(cfg)
    BlockHasher(api.hash)  # e.g. an unset seed that vLLM would randomize
    if args.workers is not None and args.workers <= 0:
        raise ConfigError(f"--workers: must be > 0, got {args.workers}")
    return _Setup(api, gunicorn_settings(api, args.workers, args.bind))


def main(argv: list[str]) -> int:
    p = shell.parser(_PROG, __doc__.splitlines()[0], metrics_port=False)
    p.add_argument("--workers", type=int, help="worker processes (default: http.workers)")
    p.add_argument("--bind", help="HOST:PORT to listen on (default: http.addr)")
    try:
        boot = shell.start(p, argv, _settings)
        server = _Server(boot.settings.api, boot.process.redis, boot.settings.gunicorn)
    except shell.ExitStatus as exc:
        return exc.code
    except ConfigError as exc:
        return shell.config_failure(_PROG, exc).code
    # the numpy fallback hashes slower (docs/design.md, "Block hashing"): say which one runs
    log = logger.info if blockhash_native.ENCODER is not None else logger.warning
    log("%s", blockhash_native.status())
    try:
        server.run()
    except SystemExit as exc:  # the arbiter exits through sys.exit
        return exc.code if isinstance(exc.code, int) else 1
    return 0
