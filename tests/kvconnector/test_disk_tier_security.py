"""A disk tier's pages are a tenant's KV: the owner's alone, gone with their worker, and each
app's in a directory of its own.

Before the fix page files were 0644 in a 0755 directory, nothing was deleted on close (pages
of a removed worker or of a `pdserve down` app stayed forever), and two apps sharing
``kv_tier_disk_path`` used the same ``<path>/<worker>`` directories, deleting each other's
pages at start. Real engines, real files in tmp_path.
"""

from __future__ import annotations

import os
import stat
import threading

from pdserve.deploy.config import PDServeConfig
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.kvconnector.tier.tier_connector import TierConnector
from pdserve.messages.engine_config import EngineConfig
from pdserve.messages.kv_tier_config import KVTierConfig
from pdserve.messages.worker_spec import WorkerSpec
from pdserve.worker.engine_host import EngineHost

PAGE_BYTES = 64 * 1024  # tiny model: 4 layers x K,V x 16 tokens x 4 heads x 64 x fp32
ENGINE = dict(num_kv_blocks=16, block_size=16, max_num_seqs=1)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def fill_the_disk_tier(engine: LLMEngine) -> None:
    """Four 96-token prompts through a 15-block pool: the evicted blocks go to disk."""
    for i in range(4):
        engine.generate([[1 + (i * 97 + t) % 499 for t in range(96)]], PARAMS)
    disk = engine.connector.store.levels[-1]
    while disk.num_queued():
        threading.Event().wait(0.01)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_pages_and_their_directory_are_the_owners_alone_and_deleted_on_close(tmp_path):
    old_umask = os.umask(0o022)  # the usual default: files 0644, directories 0755
    try:
        engine = LLMEngine.from_pretrained(
            "tiny",
            connector=TierConnector(
                KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES), "worker-0"
            ),
            **ENGINE,
        )
        fill_the_disk_tier(engine)
    finally:
        os.umask(old_umask)
    worker_directory = tmp_path / "worker-0"
    run = engine.connector.store.levels[-1].directory
    assert run.parent == worker_directory
    pages = list(run.glob("*.kv"))
    assert pages, "nothing reached the disk tier: the test proves nothing"
    assert mode(worker_directory) == mode(run) == 0o700
    assert {mode(page) for page in pages} == {0o600}

    engine.shutdown()
    assert not worker_directory.exists()


def test_two_apps_sharing_a_disk_path_get_a_directory_each():
    def disk_path_of(app_name: str) -> str:
        config = PDServeConfig(
            model="tiny",
            app_name=app_name,
            kv_tier_disk_path="/srv/kv",
            kv_tier_disk_bytes=64 * PAGE_BYTES,
        ).resolve_deployment_secrets()
        tier = config.worker_spec("producer", 0).kv_tier
        assert tier is not None
        return tier.disk_path

    assert disk_path_of("chat") == "/srv/kv/chat"
    assert disk_path_of("agents") == "/srv/kv/agents"


def test_a_stopped_worker_deletes_its_pages(tmp_path):
    """Serve calls ``__del__`` when it stops a replica (scale-down, ``pdserve down``)."""
    spec = WorkerSpec(
        "decode-1",
        EngineConfig(model="tiny", num_kv_blocks=16, block_size=16, max_num_seqs=1),
        kv_tier=KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES),
    )
    host = EngineHost(spec)
    fill_the_disk_tier(host.engine)
    assert list((tmp_path / "decode-1").rglob("*.kv"))
    host.__del__()
    assert not (tmp_path / "decode-1").exists()


def test_a_new_instance_of_a_worker_never_writes_into_its_predecessors_run(tmp_path):
    """Serve may start a worker's new instance while the old one is still stopping: each
    run has its own directory, the new one deletes the old run's pages at start (they would
    not be trusted), and the old one's close then leaves the new run alone."""
    config = KVTierConfig(disk_path=str(tmp_path), disk_bytes=64 * PAGE_BYTES)

    def engine() -> LLMEngine:
        return LLMEngine.from_pretrained(
            "tiny", connector=TierConnector(config, "worker-0"), **ENGINE
        )

    old = engine()
    fill_the_disk_tier(old)
    old_run = old.connector.store.levels[-1].directory
    assert list(old_run.glob("*.kv"))
    new = engine()
    new_run = new.connector.store.levels[-1].directory
    assert new_run != old_run and not old_run.exists()
    fill_the_disk_tier(new)
    old.shutdown()  # the old instance stops after the new one started
    assert list(new_run.glob("*.kv")), "the old instance's close deleted the new run's pages"
    new.shutdown()
    assert not (tmp_path / "worker-0").exists()
