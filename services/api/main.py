"""``cache-indexer api --config FILE [--workers N] [--bind HOST:PORT]``: the API under gunicorn.

The config (and the block-hash settings it implies) is validated here, in the master, so a
bad file exits with status 2 before any worker starts. gunicorn then runs in-process
(:class:`gunicorn.app.base.BaseApplication`); each worker builds its app after the fork
(:func:`services.api.app.build_app`). SIGTERM stops gracefully within ``http.shutdownTimeout``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gunicorn.app.base import BaseApplication

from common.blockhash import BlockHasher
from common.config import Config, config_path_from, load_config
from common.errors import ConfigError
from common.logs import configure
from services.api.app import App, build_app, hash_settings
from services.api.gunicorn_conf import gunicorn_settings


class _Server(BaseApplication):  # type: ignore[misc]
    def __init__(self, config: Config, settings: dict[str, Any]) -> None:
        self.config, self.settings = config, settings
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
        return build_app(self.config)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cache-indexer api", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="config file (default: $CACHE_INDEXER_CONFIG)")
    parser.add_argument("--workers", type=int, help="worker processes (default: http.workers)")
    parser.add_argument("--bind", help="HOST:PORT to listen on (default: http.addr)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    try:
        config = load_config(config_path_from(args.config))
        BlockHasher(hash_settings(config))  # e.g. an unset seed that vLLM would randomize
        if args.workers is not None and args.workers <= 0:
            raise ConfigError(f"--workers: must be > 0, got {args.workers}")
        settings = gunicorn_settings(config, args.workers, args.bind)
        configure(config.log.level, config.log.format)
        server = _Server(config, settings)
    except ConfigError as exc:
        print(f"cache-indexer api: {exc}", file=sys.stderr)
        return 2
    try:
        server.run()
    except SystemExit as exc:  # the arbiter exits through sys.exit
        return exc.code if isinstance(exc.code, int) else 1
    return 0
