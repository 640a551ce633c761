"""``LoRARegistry``'s invariants under any sequence of loads, unloads, requests and ends
(hypothesis): at most ``max_loras`` adapters in memory; an adapter a live request runs is
never evicted; a request gets the weights its name is registered over now; a refusal
changes nothing.

The adapters' folders are stood in for by a dict of name → digest (``read`` is replaced):
what is checked is the ledger, and ``tests/engine/test_lora.py`` reads real PEFT folders.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.lora_registry import LoRARegistry
from pdserve.model.lora.peft_adapter import LoRAAdapter

FOLDERS = {f"/adapters/{i}": f"digest-{i}" for i in range(4)}
NAMES = ["a", "b", "c"]

operations = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.sampled_from(NAMES), st.sampled_from(sorted(FOLDERS))),
        st.tuples(st.just("unload"), st.sampled_from(NAMES)),
        st.tuples(st.just("request"), st.sampled_from(NAMES), st.sampled_from(sorted(FOLDERS))),
        st.tuples(st.just("end"), st.integers(0, 7)),
    ),
    max_size=40,
)


def registry(max_loras: int, live: list[LoRAAdapter]) -> LoRARegistry:
    ledger = LoRARegistry(
        model=None,  # type: ignore[arg-type]  # read is replaced: no model is asked
        max_loras=max_loras,
        max_rank=16,
        load_on_demand=True,
        digests_in_use=lambda: {adapter.digest for adapter in live},
    )
    ledger.read = lambda name, path: LoRAAdapter(name, FOLDERS[path], {})  # type: ignore[method-assign]
    return ledger


@settings(max_examples=300, deadline=None)
@given(max_loras=st.integers(1, 3), steps=operations)
def test_the_ledger_keeps_its_invariants(max_loras: int, steps: list[tuple]) -> None:
    live: list[LoRAAdapter] = []  # the adapters of the requests running now
    ledger = registry(max_loras, live)
    for step in steps:
        before = (dict(ledger.registered), list(ledger.resident))
        try:
            if step[0] == "load":
                ledger.load(step[1], step[2])
            elif step[0] == "unload":
                assert ledger.unload(step[1]) == (step[1] in before[0])
            elif step[0] == "request":
                adapter = ledger.for_request(step[1], step[2])
                assert adapter.digest == ledger.registered[step[1]].digest
                assert adapter.digest in ledger.resident
                live.append(adapter)
            elif live:
                live.pop(step[1] % len(live))
        except ValueError:
            assert (dict(ledger.registered), list(ledger.resident)) == before
            if step[0] == "request":  # refused only when every adapter in memory is busy
                assert len(ledger.resident) == max_loras
                assert all(d in {a.digest for a in live} for d in ledger.resident)
        assert len(ledger.resident) <= max_loras
        assert {adapter.digest for adapter in live} <= set(ledger.resident)
        assert all(ref.name == name for name, ref in ledger.registered.items())


def test_a_request_for_an_evicted_adapter_reads_it_again_and_evicts_the_least_recent() -> None:
    live: list[LoRAAdapter] = []
    ledger = registry(2, live)
    for name, folder in zip(NAMES, FOLDERS):
        ledger.load(name, folder)  # "c" evicts "a": the least recently used
    assert [a.name for a in ledger.resident.values()] == ["b", "c"]
    generation = ledger.generation
    ledger.for_request("b")  # now "c" is the least recent
    assert ledger.generation == generation  # the order is not reported
    ledger.for_request("a")
    assert [a.name for a in ledger.resident.values()] == ["b", "a"]
    assert ledger.generation > generation and ledger.requests_by_name == {"a": 1, "b": 1}
    report = ledger.report("instance")
    assert (report.instance_id, report.resident) == ("instance", ["b", "a"])
    assert [ref.name for ref in report.registered] == ["a", "b", "c"]
