"""Segment names and replica endpoints → pod IPs, for one master at one time.

Every naming form maps by its host: vLLM and vllm-ascend ≥ v0.13 ``{pod IP}:{port}``, the old
HCCL transport / vllm-ascend v0.11 ``{ip}:{port}:npu_{N}``, ``[v6]:port``
(:func:`~services.l3_poller.keys_parser.host_of`).
"""

from __future__ import annotations

import ipaddress

from services.l3_poller.keys_parser import host_of


def canonical_ip(host: str) -> str:
    """``FD00:0::1`` → ``fd00::1``; anything that is not an IP address is kept as is."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


class SegmentMap:
    """Segments of one master at one time: which pod IPs have segments, endpoint → pod IP."""

    def __init__(self, segments: list[str], detail: dict[str, str] | None) -> None:
        self.names = set(segments)
        self.attached = {canonical_ip(host_of(s)) for s in segments}
        self.detailed = detail is not None
        self._ep_ip = {ep: canonical_ip(host_of(seg)) for ep, seg in (detail or {}).items()}

    def ip_of(self, endpoint: str) -> str | None:
        """Pod IP of a replica endpoint, ``None`` when no live segment matches it.

        With ``/get_segments_detail`` the te_endpoint table is exact; without it (≤ 0.3.11)
        the endpoint's host must be the host of a listed segment (P2PHANDSHAKE endpoints
        have another port than the segment name, so ports cannot be compared).
        """
        ip = self._ep_ip.get(endpoint)
        if ip is not None:
            return ip
        if self.detailed and endpoint not in self.names:
            return None
        ip = canonical_ip(host_of(endpoint))
        return ip if ip in self.attached else None
