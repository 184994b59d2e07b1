"""L3 key parsing and the rehash check at their edges (issue 33, found by mutation testing):
a key that is only ``@<hash>`` has no prefix and is no key; the units the rehash check looks
at are found among keys of other units in any order."""

from __future__ import annotations

from services.l3_poller.completeness import unmappable_units
from services.l3_poller.keys_parser import host_of
from tests.keys_oracle import split_key

HEX = b"%064x" % 0xABC


def test_a_key_without_a_prefix_is_no_key() -> None:
    assert split_key(b"@" + HEX) is None
    assert split_key(HEX) is None
    assert split_key(b"M@" + HEX) == (b"M", b"", 0xABC)


def test_the_rehash_check_reads_past_keys_of_other_units() -> None:
    """Unit 0 is no candidate; units 1 and 2 (one deployment) share no hash: both reported,
    however the keys of unit 0 are interleaved."""
    unit_of = [0, 1, 2]
    candidates = {1: 7, 2: 7}
    keys = [0 << 64 | 5, 1 << 64 | 10, 0 << 64 | 6, 2 << 64 | 11, 2 << 64 | 12]
    assert unmappable_units(keys, unit_of, candidates) == {1: 1, 2: 2}
    shared = [0 << 64 | 5, 1 << 64 | 10, 2 << 64 | 10, 2 << 64 | 12]
    assert unmappable_units(shared, unit_of, candidates) == {}


def test_host_of_a_bracketed_endpoint_and_its_malformed_forms() -> None:
    assert host_of("[fd00::1]:12345") == "fd00::1"
    assert host_of("[fd00::1") == "[fd00::1"  # no closing bracket: left whole
    assert host_of("[]:12345") == ""
