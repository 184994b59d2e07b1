"""Every field of a registered instance comes back from the registry, the served model and
the HTTP endpoint too (the model is matched against ``ingest.l1.models``).

Issue 33 (mutation testing of ``common/store.py``): ``Instance.from_meta`` dropping the model
passed the suite, whose round-trip test registers neither a model nor an HTTP endpoint.
"""

from __future__ import annotations

import dataclasses

from common.store import Instance, Store

IP = "10.0.0.8"


def test_every_field_round_trips_through_the_registry(any_store: Store) -> None:
    store = any_store
    inst = Instance(
        ip=IP,
        uid="u-9",
        pod="vllm-9",
        zmq_endpoint="tcp://10.0.0.8:5557",
        replay_endpoint="tcp://10.0.0.8:5558",
        dp_size=2,
        role="aggregate",
        restarts="1",
        model="Qwen/Qwen3-8B",
        http_endpoint="http://10.0.0.8:8000",
    )
    _, gen = store.upsert_instance(inst)
    want = dataclasses.replace(inst, gen=gen)
    assert store.get_instance(IP) == want
    assert store.list_instances() == [want]
    moved = dataclasses.replace(inst, model="Qwen/Qwen3-32B", http_endpoint="http://10.0.0.8:9000")
    assert store.upsert_instance(moved) == ("updated", gen)
    assert store.list_instances() == [dataclasses.replace(moved, gen=gen)]
