"""A worker pinned to CPUs (``prefill_cpus`` / ``decode_cpus``) runs on exactly those, and a
CPU the node does not have is refused by name. Run in a child process: pinning the test
process would pin the rest of the suite."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.deploy.config import PDServeConfig
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.worker.engine_host import _pin_to
from tests.child_processes import child_context


def _affinity_after_pinning(cpus: tuple[int, ...]) -> set[int] | str:
    try:
        _pin_to("decode-0", cpus)
    except ValueError as error:
        return str(error)
    return os.sched_getaffinity(0)


def _in_child(cpus: tuple[int, ...]):
    with child_context().Pool(1) as pool:
        return pool.apply(_affinity_after_pinning, (cpus,))


def test_a_pinned_worker_runs_on_its_cpus_and_an_absent_cpu_is_refused_by_name():
    first = min(os.sched_getaffinity(0))
    assert _in_child((first,)) == {first}
    absent = max(os.sched_getaffinity(0)) + 1000
    assert f"[{absent}] are not among this node's usable CPUs" in _in_child((first, absent))


def _engine_thread_affinity(cpus: tuple[int, ...]) -> set[int]:
    """Builds a pinned worker on one thread and starts its engine thread from another, as
    Ray runs an actor's constructor and its event loop on different threads."""
    from pdserve.messages.engine_config import EngineConfig
    from pdserve.worker.engine_host import EngineHost

    hosts: list[EngineHost] = []
    constructor = threading.Thread(
        target=lambda: hosts.append(
            EngineHost(WorkerSpec("worker-0", EngineConfig(model="tiny"), cpus=cpus))
        )
    )
    constructor.start()
    constructor.join()
    engine_thread_id = hosts[0]._executor.submit(threading.get_native_id).result()
    return os.sched_getaffinity(engine_thread_id)


def test_the_engine_thread_of_a_pinned_worker_runs_on_its_cpus():
    first = min(os.sched_getaffinity(0))
    with child_context().Pool(1) as pool:
        assert pool.apply(_engine_thread_affinity, ((first,),)) == {first}


def test_each_role_gets_its_own_cpus_in_its_spec():
    config = PDServeConfig(
        model="tiny", prefill_cpus=[0, 1], decode_cpus=[2]
    ).resolve_deployment_secrets()
    assert config.worker_spec("producer", 0).cpus == (0, 1)
    assert config.worker_spec("consumer", 0).cpus == (2,)
    assert (
        PDServeConfig(model="tiny").resolve_deployment_secrets().worker_spec("consumer", 0).cpus
        is None
    )
    with pytest.raises(ValueError, match="cpus must name at least one CPU"):
        WorkerSpec("decode-0", config.worker_spec("consumer", 0).engine, cpus=())
