"""A real prefill engine (tiny model + PDConnector producer) in its own process.

The test process plays the decode worker. Commands go over a pipe; between commands the
child keeps stepping its engine, so leases released by the decode side (or expired) free
their blocks as they would in a PrefillWorker.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from pdserve.engine import SamplingParams
from tests.child_processes import child_context

# Dequantized (smollm2): speculation's exact-equality checks need float32's numerics
# (``test_speculative_decoding.py``'s ``make_engine`` says why).
ENGINE_KWARGS = dict(
    block_size=16, num_kv_blocks=256, max_num_batched_tokens=512, quantization="none"
)


@dataclass(frozen=True)
class PrefillSpec:
    transport: str = "grpc"
    lease_ttl_s: float = 30.0
    hash_seed: int = 0
    secret: str | None = None
    port: int = 0  # fixed: a restart comes back on the same address
    engine_id: str = "prefill-0"  # a restarted worker is a new engine: a new id
    kv_cache_dtype: str = "auto"
    model: str = "tiny"  # or a directory of a saved HF model
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) pairs


@dataclass(frozen=True)
class PrefillState:
    kv_cache_usage: float
    num_held_requests: int
    num_leases: int
    num_lease_expiries: int
    num_blocks_sent: int


def _run(spec: PrefillSpec, conn: Any) -> None:
    from pdserve.engine import LLMEngine
    from pdserve.kvconnector.pd.pd_connector import PDConnector
    from pdserve.messages.connector_config import KVConnectorConfig

    faults = {"die_on_read": False, "stall_s": 0.0}

    def fault_injector(block_ids: list[int], packed: bytearray) -> None:
        if faults["die_on_read"]:
            os._exit(9)  # the process dies with the stream half sent
        if faults["stall_s"]:
            time.sleep(faults["stall_s"])

    connector = PDConnector(
        KVConnectorConfig(
            role="producer",
            transport=spec.transport,
            port=spec.port,
            lease_ttl_s=spec.lease_ttl_s,
            secret=spec.secret,
            allow_insecure=spec.secret is None,
        ),  # loopback unit tests only
        engine_id=spec.engine_id,
        hash_algorithm="xxh3_128",
        hash_seed=spec.hash_seed,
        fault_injector=fault_injector,
    )
    engine = LLMEngine.from_pretrained(
        spec.model,
        connector=connector,
        hash_seed=spec.hash_seed,
        engine_id=spec.engine_id,
        kv_cache_dtype=spec.kv_cache_dtype,
        lora_modules=dict(spec.lora_modules),
        **ENGINE_KWARGS,
    )
    conn.send(connector.address)
    while True:
        if not conn.poll(0.002):
            if engine.has_unfinished_requests() or engine.num_leases_held > 0:
                engine.step()
            continue
        command, *args = conn.recv()
        if command == "prefill":
            request_id, prompt, params, lora_name = args
            engine.add_request(request_id, prompt, params, remote_decode=True, lora_name=lora_name)
            while True:
                done = [o for o in engine.step() if o.request_id == request_id and o.finished]
                if done:  # as PrefillWorker's stream does, off the step path
                    if done[0].kv_transfer_params is not None:  # None: no hand-off
                        connector.complete_transfer_params(done[0].kv_transfer_params)
                    conn.send(done[0])
                    break
        elif command == "corrupt":
            (block_id,) = args
            engine.runner.kv_cache[block_id].view(-1)[5] += 1.0
            conn.send(None)
        elif command == "fault":
            faults.update(args[0])
            conn.send(None)
        elif command == "state":
            stats = engine.stats()
            conn.send(
                PrefillState(
                    kv_cache_usage=stats.kv_cache_usage,
                    num_held_requests=len(engine.scheduler.held_for_transfer),
                    num_leases=len(connector.leases),
                    num_lease_expiries=stats.transfer.num_lease_expiries,
                    num_blocks_sent=stats.transfer.num_blocks_sent,
                )
            )
        elif command == "stop":
            engine.shutdown()
            conn.send(None)
            return


class PrefillProcess:
    """Handle on the child: prefill a prompt, inject a fault, read its state, stop or kill."""

    def __init__(self, spec: PrefillSpec) -> None:
        context = child_context()
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_run, args=(spec, child_conn), daemon=True)
        self.process.start()
        if not self._conn.poll(120):
            raise TimeoutError("prefill process did not start")
        self.address: str = self._conn.recv()

    def _call(self, *command: Any, timeout_s: float = 60.0) -> Any:
        self._conn.send(command)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"prefill process did not answer {command[0]!r}")
        return self._conn.recv()

    def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
    ):
        return self._call("prefill", request_id, prompt, params, lora_name)

    def corrupt(self, block_id: int) -> None:
        self._call("corrupt", block_id)

    def fault(self, **faults: Any) -> None:
        self._call("fault", faults)

    def state(self) -> PrefillState:
        return self._call("state")

    def wait_until_idle(self, timeout_s: float = 30.0) -> PrefillState:
        """Polls until no block is referenced and no lease is held (or raises)."""
        deadline = time.monotonic() + timeout_s
        state = self.state()
        while state.kv_cache_usage > 0 or state.num_leases or state.num_held_requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"prefill side still holds blocks: {state}")
            time.sleep(0.05)
            state = self.state()
        return state

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("stop", timeout_s=10)
            except (TimeoutError, OSError, EOFError):
                pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
