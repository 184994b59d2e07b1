"""How a vLLM deployment hashes blocks (:class:`HashSettings`: algo, PYTHONHASHSEED,
release) and the root of every chain it derives from them (NONE_HASH); pure, no I/O.

:mod:`common.blockhash` hashes with them and re-exports every name here.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from dataclasses import dataclass

from common import blockhash_cbor as cbor
from common.errors import ConfigError

ALGOS = ("sha256_cbor", "sha256")
MIN_VLLM_VERSION = (0, 10, 2)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM >= 0.29 when PYTHONHASHSEED is unset

_FIXED_NONE_HASH_SINCE = (0, 29, 0)
_VERSION_RE = re.compile(
    r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:(?:a|b|rc|\.post|\.dev)\d*)*(?:\+[0-9A-Za-z.]+)?"
)


def parse_vllm_version(text: str) -> tuple[int, int, int]:
    """Parse "0.28.0" (also "0.28", "v0.28.0", "0.28.0rc1", "0.28.0+cu128"); pre-release
    and local suffixes are ignored. Raises ConfigError on anything else."""
    match = _VERSION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"vLLM version {text!r} is not of the form X.Y.Z")
    major, minor, patch = match.group(1, 2, 3)
    return int(major), int(minor), int(patch or 0)


@dataclass(frozen=True)
class HashSettings:
    """How a vLLM deployment hashes blocks: ``--prefix-caching-hash-algo``, the engine's
    PYTHONHASHSEED (None when unset) and the vLLM release."""

    algo: str = "sha256_cbor"
    seed: str | None = "0"
    vllm_version: tuple[int, int, int] = (0, 28, 0)

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ConfigError(
                f"hash algo {self.algo!r} is not supported; use one of {', '.join(ALGOS)}"
            )
        if self.seed is not None and not isinstance(self.seed, str):
            raise ConfigError(f"PYTHONHASHSEED must be a string or unset, not {self.seed!r}")
        version = self.vllm_version
        if not (
            isinstance(version, tuple)
            and len(version) == 3
            and all(isinstance(part, int) and part >= 0 for part in version)
        ):
            raise ConfigError(f"vLLM version {version!r} is not a (major, minor, patch) tuple")
        if version < MIN_VLLM_VERSION:
            shown = ".".join(map(str, version))
            raise ConfigError(
                f"vLLM {shown} is not supported: its block hashes are not "
                "reproducible (need 0.10.2 or newer)"
            )

    @classmethod
    def from_strings(cls, algo: str, seed: str | None, vllm_version: str) -> HashSettings:
        """Build settings from config/CLI strings; raises ConfigError on bad values."""
        return cls(algo=algo, seed=seed, vllm_version=parse_vllm_version(vllm_version))


def effective_seed(settings: HashSettings) -> str:
    """The seed vLLM derives NONE_HASH from: the configured one, else vLLM >= 0.29's fixed
    default; raises ConfigError when it is unset for an older vLLM."""
    if settings.seed is not None:
        return settings.seed
    if settings.vllm_version < _FIXED_NONE_HASH_SINCE:
        raise ConfigError(
            "PYTHONHASHSEED is unset: vLLM < 0.29 then draws a random NONE_HASH per "
            "process, so its block hashes are random and cannot be reproduced; set "
            "PYTHONHASHSEED on the vLLM pods and the same value in blockKey.pythonHashSeed"
        )
    return DEFAULT_NONE_HASH_SEED


def none_hash(settings: HashSettings) -> bytes:
    """NONE_HASH, the parent digest of block 0, for these settings (32 bytes)."""
    return seed_none_hash(settings.algo, effective_seed(settings))


def seed_none_hash(algo: str, seed: str) -> bytes:
    """NONE_HASH for an explicit seed string (no version rules): ``sha256(serialize(seed))``."""
    return hashlib.sha256(_serialize(algo, seed)).digest()


def _serialize(algo: str, obj: object) -> bytes:
    if algo == "sha256":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cbor.encode(obj)
