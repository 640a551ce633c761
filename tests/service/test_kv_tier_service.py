"""A 1 prefill + 1 decode app with a KV tier on both workers, on a real local Ray cluster.

Each worker's pool (15 usable blocks) holds one of the four long system prompts at a time,
so the prompts that come round again load back from the tier (cpu on the prefill worker,
cpu over disk on the decode worker) instead of being computed or pulled. The text must equal
the colocated engine's, the tier's figures must reach /stats and /metrics, and after the
drain no block or lease may be held.
"""

from __future__ import annotations

import urllib.request

import pytest

from bench.load_driver import is_drained, wait_until_drained
from pdserve.deploy.cluster import base_url
from tests.service.service_apps import (
    assert_completions_equal_colocated,
    openai_client,
    running_app,
)

SYSTEMS = [
    f"System prompt {name}: " + f"you are a {name} assistant; answer in one line. " * 2
    for name in ("terse", "verbose", "polite", "grumpy")
]
PROMPTS = [SYSTEMS[i % 4] + f"Question {i}?" for i in range(8)]
PAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-tier")
    with running_app(
        num_kv_blocks=16,
        num_prefill=1,
        num_decode=1,
        max_model_len=240,
        kv_tier_cpu_bytes=16 * PAGE_BYTES,
        kv_tier_disk_path=str(disk),
        kv_tier_disk_bytes=64 * PAGE_BYTES,
    ) as config:
        yield config


def test_a_tiered_1p1d_app_gives_the_colocated_text_and_loads_from_its_tiers(service, colocated):
    client = openai_client(service)
    assert_completions_equal_colocated(client, colocated, PROMPTS, 6, dict(temperature=0.0))
    workers = wait_until_drained(service)
    assert all(is_drained(w) for w in workers), workers
    prefill, decode = workers
    assert sum(prefill["kv_tier_blocks_loaded"].values()) > 0  # prompts not computed again
    assert sum(decode["kv_tier_blocks_loaded"].values()) > 0  # blocks not pulled again
    assert all(sum(w["kv_tier_load_failures"].values()) == 0 for w in workers)
    # What no tier held was pulled from the prefill worker, intact: nothing recomputed.
    assert decode["num_blocks_received"] > 0 and decode["num_recompute_fallbacks"] == 0
    with urllib.request.urlopen(base_url(service) + "/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert "pdserve:kv_tier_blocks_loaded_total{" in metrics and 'tier="cpu"' in metrics
