"""The project's error hierarchy; what each kind of error makes a process do.

CacheIndexerError
 ├── ConfigError        a bad config file or flag: the process exits with status 2
 ├── DecodeError        a malformed KV event, event batch or replay reply: drop it, count it
 │    └── NotABatchError  a ZMQ payload that is not an EventBatch at all
 ├── UpstreamError      a peer failed: back off, retry
 │    ├── FencedError   the store refused an L1 write (see the class)
 │    └── MasterError   a Mooncake master request or body failed (l3_poller/client.py)
 └── RequestError       a bad hit-rate request: answered with its HTTP status

Redis, ZMQ and Kubernetes errors are not wrapped: the loops catch ``redis.RedisError``,
``zmq.ZMQError`` and ``ApiException`` themselves, where they back off and retry. Only the L3
client wraps its httpx errors, as MasterError with a reason label.
"""

from __future__ import annotations


class CacheIndexerError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(CacheIndexerError):
    """The config file or the command line is invalid; the message names the key."""


class DecodeError(CacheIndexerError):
    """A message could not be decoded; ``reason`` is a short label for counters."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class NotABatchError(DecodeError):
    """A payload that is not a msgpack EventBatch (not msgpack, not an array, …)."""


class UpstreamError(CacheIndexerError):
    """A peer failed in a way this project names itself (see the tree above)."""


class FencedError(UpstreamError):
    """The store refused an L1 write; ``status`` is its verdict (``common.store.BatchStatus``).

    Raised by the L1 rank stream (its module docstring says for which verdicts) and handled
    by the subscriber like any upstream failure (its module docstring). The store returns
    verdicts rather than raising: a duplicate is no error, the L3 writer only skips a refusal."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


class RequestError(CacheIndexerError):
    """A hit-rate request that must be answered with ``status`` and a one-sentence message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
