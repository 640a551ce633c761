"""Helpers of the service suite: deploy a shape on the shared cluster, read its stats."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from bench.load_driver import get_json, wait_until_drained, worker_rows
from pdserve.deploy.cluster import auth_headers, base_url, delete_app, deploy
from pdserve.deploy.config import PDServeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from tests.ports import free_port

NUM_KV_BLOCKS = 256
T = TypeVar("T")


SERVE_PORT = free_port()
# The app modules share (see ``running_app``), and what every deploy of it keeps equal so that
# Serve keeps the workers whose spec did not change: the hash seed and the KV secret.
SHARED_APP = "svc"
SHARED_SECRETS = {"hash_seed": 20_261_201, "kv_transfer_secret": secrets.token_urlsafe(32)}
_entered: list[PDServeConfig] = []  # the apps of the running_app blocks now open


@contextlib.contextmanager
def running_app(num_kv_blocks: int = NUM_KV_BLOCKS, **fields) -> Iterator[PDServeConfig]:
    """Deploys one pdserve app on the shared cluster.

    Without an ``app_name`` the app is the suite's shared one: each module redeploys it with
    its own settings and leaves it running when done, and Serve keeps every worker whose
    spec (engine, connector, tier) did not change and replaces the rest, the gateway always.
    A module that changes only gateway settings (ports, admission, the disaggregation
    threshold) starts one process, not a whole app: ≈ 3 s instead of 9 to 15 on 2 cores. So
    its workers may hold what an earlier module left: prefix caches, counters, restarted
    instances; a test here reads counters as growth and sends prompts of its own.
    An ``app_name``, or a block inside another one, gets an app of its own, deleted after.

    ``num_kv_blocks`` below the default makes a pool that fills up on purpose; every
    request is disaggregated unless ``disagg_min_uncached_tokens`` (or
    ``decode_reuse_min_tokens``) is given."""
    shared = "app_name" not in fields and not _entered
    if shared:
        fields = {**fields, "app_name": SHARED_APP, "route_prefix": f"/{SHARED_APP}"}
    # Always disaggregate unless a test says otherwise: most tests specify the hand-off.
    config = PDServeConfig(
        **{
            "model": "tiny",
            "port": SERVE_PORT,
            "num_kv_blocks": num_kv_blocks,
            "disagg_min_uncached_tokens": 0,
            "decode_reuse_min_tokens": 0,
            **SHARED_SECRETS,
            **fields,
        }
    )
    deploy(config)
    _entered.append(config)
    try:
        yield config
    finally:
        _entered.pop()
        if not shared:
            delete_app(config.app_name)


def skip_without(transport: str) -> None:
    """Skips the test when ``transport`` cannot run here (NIXL not installed)."""
    from pdserve.kvconnector.transport.nixl_transport import nixl_available

    if transport == "nixl" and not nixl_available():
        import pytest

        pytest.skip("NIXL does not load here (pip install 'pdserve[nixl]')")


@contextlib.contextmanager
def running_shape(
    num_prefill: int, num_decode: int, transport: str, **fields
) -> Iterator[PDServeConfig]:
    """``running_app`` of one P/D shape and transport (skipped without it), once ready."""
    skip_without(transport)
    with running_app(
        num_prefill=num_prefill, num_decode=num_decode, transport=transport, **fields
    ) as config:
        assert wait_until_ready(config)["ready"]  # every decode worker handshook
        yield config


def expected_text(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> str:
    return engine.generate([prompt], params)[0].text


def assert_completions_equal_colocated(
    client, colocated: LLMEngine, prompts: list[str], max_tokens: int, sampling: dict
) -> None:
    """Whole and streamed completions through the gateway equal the colocated engine's text."""
    for prompt in prompts:
        expected = expected_text(
            colocated, prompt, SamplingParams(max_tokens=max_tokens, **sampling)
        )
        whole = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, **sampling
        )
        assert whole.choices[0].text == expected
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, **sampling
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected


def openai_client(config: PDServeConfig):
    """The official OpenAI client pointed at the app's gateway, without client-side retries."""
    import openai

    keys = config.api_key or ["unused"]
    return openai.OpenAI(base_url=base_url(config) + "/v1", api_key=keys[0], max_retries=0)


def anthropic_client(config: PDServeConfig, key: str | None = None):
    """The official Anthropic client pointed at the app's gateway (its key as ``x-api-key``),
    without client-side retries."""
    import anthropic

    keys = config.api_key or ["unused"]
    return anthropic.Anthropic(base_url=base_url(config), api_key=key or keys[0], max_retries=0)


def post_completion(config: PDServeConfig, body: dict) -> tuple[int, dict[str, str], dict]:
    """(status, headers with lower-case names, JSON body) of one ``/v1/completions`` call."""
    request = urllib.request.Request(
        base_url(config) + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers(config)},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, _lower(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, _lower(error.headers), json.loads(error.read())


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


# ---------------------------------------------------------------------- faults (test_faults.py)


def _replica_actor(config: PDServeConfig, worker_id: str):
    """The Serve replica actor that serves ``worker_id`` now.

    A replica Serve replaced (its health check failed) lives on, named, through its graceful
    shutdown: a fault injected there, or a SIGSTOP sent to it, would miss the worker the
    gateway routes to. With more than one, the one whose instance ``/stats`` shows wins."""
    import ray

    replicas = [
        ray.get_actor(entry["name"], namespace=entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith("SERVE_REPLICA::")
        and f"{config.app_name}#{worker_id}#" in entry["name"]
    ]
    if len(replicas) == 1:
        return replicas[0]
    serving = worker_rows(config)[worker_id]["instance_id"]
    for replica in replicas:
        asked = replica.__ray_call__.remote(
            lambda r: getattr(r._replica_impl._user_callable_wrapper._callable, "instance_id", None)
        )
        ready, _ = ray.wait([asked], timeout=10)  # a replica stuck in its shutdown: not it
        if ready and ray.get(asked) == serving:
            return replica
    raise LookupError(
        f"no replica actor of {worker_id} in app {config.app_name} serves instance {serving}"
    )


def kill_worker(config: PDServeConfig, worker_id: str) -> int:
    """SIGKILLs the process of ``worker_id``'s Serve replica (as the OOM killer would);
    returns its pid. Serve notices the dead actor and starts a new replica."""
    import signal

    return signal_worker(config, worker_id, signal.SIGKILL)


def signal_worker(config: PDServeConfig, worker_id: str, signum: int) -> int:
    """Sends ``signum`` to the process of ``worker_id``'s Serve replica; returns its pid."""
    import os

    import ray

    actor = _replica_actor(config, worker_id)
    pid = ray.get(actor.__ray_call__.remote(lambda _replica: os.getpid()), timeout=30)
    os.kill(pid, signum)
    return pid


def on_worker(config: PDServeConfig, worker_id: str, action: Callable[[Any], T]) -> T:
    """Runs ``action(worker)`` inside ``worker_id``'s process, on its live ``PrefillWorker``
    or ``DecodeWorker``, and returns the result: how a test injects a fault (a slow read, a
    short lease, a corrupted page) into a real worker of a real app. ``action`` must be a
    closure or lambda (pickled by value; the worker cannot import test modules)."""
    import ray

    def run(replica: Any) -> T:  # Serve's replica actor holds the deployment's instance
        wrapper = replica._replica_impl._user_callable_wrapper
        try:
            return action(wrapper._callable)
        finally:
            # Serve caches each method on its first call: a method the action replaced (or
            # restored) must be looked up again.
            wrapper._cached_user_method_info.clear()

    return ray.get(_replica_actor(config, worker_id).__ray_call__.remote(run), timeout=60)


def slow_steps(seconds: float, chunk_tokens: int = 0) -> Callable:
    """Every engine step sleeps ``seconds`` first, and a prompt computes ``chunk_tokens`` a
    step (0: the configured cap): a prefill that takes a while; 0 s restores both."""

    def install(worker) -> None:
        import time as worker_time

        engine = worker.engine
        engine.__dict__.pop("step", None)
        engine.scheduler.long_prefill_token_threshold = (
            chunk_tokens if seconds else worker.spec.engine.long_prefill_token_threshold
        )
        if seconds:
            step = type(engine).step

            def slow_step(*args, **kwargs):
                worker_time.sleep(seconds)
                return step(engine, *args, **kwargs)

            engine.step = slow_step

    return install


def delay_reads(seconds: float) -> Callable:
    """Prefill side: every read (gRPC stream or NIXL hold) waits ``seconds`` before it
    starts, as a stalled transfer thread would; 0 removes the delay."""

    def install(worker) -> None:
        import time as worker_time

        from pdserve.kvconnector.pd.lease import LeaseTable

        table = worker.engine.connector.leases
        table.__dict__.pop("begin_read", None)
        if seconds:

            def delayed(lease_id, block_ids, release=False):
                worker_time.sleep(seconds)
                return LeaseTable.begin_read(table, lease_id, block_ids, release)

            table.begin_read = delayed

    return install


def wait_until_restarted(
    config: PDServeConfig, worker_id: str, old_instance_id: str, timeout_s: float = 60.0
) -> dict:
    """Polls ``/stats`` and ``/health`` until ``worker_id`` answers with a new instance and
    the gateway routes to every worker again; returns its row."""
    deadline = time.time() + timeout_s
    health: dict | None = None
    while True:
        row = worker_rows(config).get(worker_id)
        if row is not None and row["instance_id"] != old_instance_id:
            try:
                health = get_json(config, "/health")
            except urllib.error.HTTPError as error:
                health = json.loads(error.read())
            if health["unavailable"] == []:
                return row
        if time.time() > deadline:
            raise TimeoutError(
                f"{worker_id} did not come back within {timeout_s} s "
                f"(its row: {row and row['instance_id']}, /health: {health})"
            )
        time.sleep(0.25)


def wait_until_ready(config: PDServeConfig, timeout_s: float = 60.0) -> dict:
    """Polls ``/ready`` until it answers 200 (every role answers, every decode worker has
    handshaken with every prefill worker); returns its body, or raises with the last one."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return get_json(config, "/ready")
        except urllib.error.HTTPError as error:
            report = json.loads(error.read())
        if time.time() > deadline:
            raise TimeoutError(f"not ready within {timeout_s} s: {report}")
        time.sleep(0.2)


def open_stream(config: PDServeConfig, body: dict, timeout_s: float = 60.0):
    """POSTs a streamed completion on a raw connection: (connection, response); the caller
    reads SSE lines with ``read_event`` and may close the connection mid-stream."""
    import http.client

    connection = http.client.HTTPConnection(config.host, config.port, timeout=timeout_s)
    connection.request(
        "POST",
        config.route_prefix.rstrip("/") + "/v1/completions",
        body=json.dumps({**body, "stream": True}),
        headers={"Content-Type": "application/json", **auth_headers(config)},
    )
    return connection, connection.getresponse()


def read_event(response) -> dict | None:
    """The next SSE ``data:`` event as JSON; None at ``[DONE]`` or the end of the stream."""
    while True:
        line = response.readline()
        if not line:
            return None
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        return None if data == b"[DONE]" else json.loads(data)


class StreamClient(threading.Thread):
    """One streamed completion in a thread: its text, finish reason or error, and a hook to
    drop the connection after ``drop_after_events`` events or ``drop_after_s`` seconds, or
    when ``drop_now`` is set (None everywhere: read to the end)."""

    def __init__(
        self,
        config: PDServeConfig,
        prompt: str | list[int],
        max_tokens: int,
        sampling: dict,
        drop_after_events: int | None = None,
        drop_after_s: float | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.config, self.prompt, self.max_tokens, self.sampling = (
            config,
            prompt,
            max_tokens,
            sampling,
        )
        self.drop_after_events, self.drop_after_s = drop_after_events, drop_after_s
        self.drop_now = threading.Event()
        self.events = 0
        self.text = ""
        self.status: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.dropped = False
        self.first_event = threading.Event()

    def drop(self) -> None:
        """Walks away now, even while waiting for the next event (the socket is shut)."""
        self.drop_now.set()
        if getattr(self, "_socket", None) is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)

    def run(self) -> None:
        body = dict(model="tiny", prompt=self.prompt, max_tokens=self.max_tokens, **self.sampling)
        connection, response = open_stream(self.config, body)
        self._socket = connection.sock
        started = time.time()
        try:
            self.status = response.status
            if response.status != 200:
                self.error = response.read().decode()
                return
            while True:
                if (
                    self.drop_now.is_set()
                    or (
                        self.drop_after_events is not None and self.events >= self.drop_after_events
                    )
                    or (self.drop_after_s is not None and time.time() - started > self.drop_after_s)
                ):
                    self.dropped = True
                    return
                try:
                    event = read_event(response)
                except Exception:  # a read cut by drop()'s shutdown of the socket
                    if not self.drop_now.is_set():
                        raise
                    event = None
                if event is None:
                    self.dropped = self.drop_now.is_set()
                    return
                if "error" in event:
                    self.error = json.dumps(event["error"])
                    return
                self.events += 1
                self.first_event.set()
                choice = event["choices"][0]
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
        finally:
            self.first_event.set()
            connection.close()  # mid-stream when dropped: the gateway sees the disconnect


def run_all(clients: list[StreamClient], timeout_s: float = 60.0) -> None:
    """Starts the clients not yet started and joins them all; a client still running after
    ``timeout_s`` is a hang."""
    for client in clients:
        if client.ident is None:
            client.start()
    for client in clients:
        client.join(timeout_s)
        assert not client.is_alive(), "a request hung"


def leftovers(workers: list[dict]) -> dict[str, tuple]:
    """Per worker that is not drained: (blocks in use, leases, running, waiting)."""
    return {
        w["worker_id"]: (
            w["num_blocks"] - 1 - w["num_free_blocks"],
            w["num_leases_held"],
            w["num_requests_running"],
            w["num_requests_waiting"],
        )
        for w in workers
        if (
            w["num_free_blocks"] != w["num_blocks"] - 1
            or w["num_leases_held"]
            or w["num_requests_running"]
            or w["num_requests_waiting"]
        )
    }


def assert_drained(config: PDServeConfig) -> None:
    """Every worker back to its baseline: all blocks free, no lease, nothing running or
    waiting; and nothing in flight at the gateway."""
    leaked = leftovers(wait_until_drained(config))
    assert leaked == {}, f"blocks, leases or requests left behind: {leaked}"
    deadline = time.time() + 20  # a dropped stream's slot is freed when its call unwinds
    while (
        in_flight := get_json(config, "/stats")["gateway"]["num_requests_in_flight"]
    ) and time.time() < deadline:
        time.sleep(0.2)
    assert in_flight == 0, f"{in_flight} requests still in flight at the gateway"
