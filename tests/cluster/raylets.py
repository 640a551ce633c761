"""Real Ray nodes on one machine: one raylet per 127.0.0.x address, started and stopped by
this test process alone.

Each node is ``ray start --block`` in a session of its own. ``--block`` keeps the ``ray
start`` process alive as the parent of the node's processes (GCS, raylet, agents, and the
workers the raylet forks), so the node is exactly that process's tree: ``kill`` SIGKILLs the
tree by process id, the way a machine that loses power takes its processes with it. Never
``ray stop``: it stops every Ray process on the machine, other engineers' included.

Several nodes on one host need ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, and the head must not
be on 127.0.0.1 (Ray then registers it under the machine's network address; see
``/work/shared/FACTS.md``). Every port is picked free, so suites running side by side do not
collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))
# Node loss is noticed after period x threshold: ~1.5 s instead of Ray's default ~15 s.
HEAD_SYSTEM_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
NODE_START_TIMEOUT_S = 90.0
# A head whose `ray start` exits while it starts is started again, on fresh ports: a CI run
# lost the whole multi-node suite to one such exit (code 1, reason unrecorded).
HEAD_START_ATTEMPTS = 3
LOG_TAIL_LINES = 30


def cluster_env() -> dict[str, str]:
    """The environment of every node and of the driver: several nodes on one host, one auth
    mode, this worktree's code on the path of every Ray worker."""
    env = dict(os.environ)
    # Ray workers import this suite's helpers (tests.cluster.kv_endpoint) by module path, as
    # the driver does: the repository root on their path, as pytest's `pythonpath` puts it on ours.
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
    )
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
        RAY_AUTH_MODE="disabled",
        OMP_NUM_THREADS="1",
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


@dataclass
class RayNode:
    """One raylet (the head also runs the GCS) at ``ip``, offering ``resources``."""

    ip: str
    resources: dict[str, float]
    head_address: str | None = None  # None: this is the head
    num_cpus: int = 2
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    temp_dir: str | None = None  # the head's; removed with it

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def start(self) -> RayNode:
        command = [
            RAY,
            "start",
            "--block",
            "--node-ip-address",
            self.ip,
            "--num-cpus",
            str(self.num_cpus),
            "--resources",
            json.dumps(self.resources),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--metrics-export-port",
            str(free_port()),
            "--min-worker-port",
            "0",
            "--max-worker-port",
            "0",
        ]
        env = cluster_env()
        if self.head_address is None:
            # A temp dir of its own: `ray start --head` records its address in the temp dir's
            # ray_current_cluster, and a later `ray.init()` anywhere on the machine that finds
            # it in the shared /tmp/ray joins this cluster instead of starting its own.
            self.temp_dir = tempfile.mkdtemp(prefix="pdr-", dir="/tmp")
            command += [
                "--head",
                "--port",
                str(self.port),
                "--include-dashboard",
                "false",
                "--ray-client-server-port",
                str(free_port()),
                "--temp-dir",
                self.temp_dir,
            ]
            env.update(HEAD_SYSTEM_ENV)
        else:
            command += ["--address", self.head_address]
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def log_path(self) -> Path:
        """Where the node's ``ray start`` writes (stdout and stderr together)."""
        return Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-raylet-{self.ip}.log"

    def log_tail(self) -> str:
        """The last lines ``ray start`` printed: why it exited, when it did."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def pids(self) -> list[int]:
        """The ``ray start`` process and every process below it."""
        import psutil

        if self.process is None:
            return []
        try:
            root = psutil.Process(self.process.pid)
            return [root.pid] + [child.pid for child in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILLs the node's processes by id (the tree, then its process group: a process
        that lost its parent meanwhile is still in the node's session)."""
        if self.process is None:
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the session we created for it
        self.process.wait(timeout=30)
        self.process = None
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def wait_for_nodes(expected_ips: set[str], timeout_s: float = NODE_START_TIMEOUT_S) -> None:
    """Polls the GCS (driver connected) until exactly ``expected_ips`` are alive."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        if alive == expected_ips:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Ray nodes alive: {alive}, expected {expected_ips}")


class HeadExited(RuntimeError):
    """``ray start --head`` exited before its GCS port opened."""


def wait_for_head(head: RayNode, timeout_s: float = NODE_START_TIMEOUT_S) -> None:
    """Until the head's GCS port accepts connections (or its process has died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.process.poll() is not None:
            raise HeadExited(
                f"ray start --head at {head.address} exited with {head.process.returncode}; "
                f"its log ends:\n{head.log_tail()}"
            )
        with contextlib.suppress(OSError), socket.create_connection((head.ip, head.port), 0.5):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the head at {head.address} did not open its port")


def start_head(ip: str, resources: dict[str, float]) -> RayNode:
    """A head at ``ip`` whose GCS accepts connections; one that exits while starting is
    killed (its tree and temp dir) and started again on fresh ports, each exit's log tail kept
    for the error if every attempt fails."""
    exits: list[str] = []
    for _ in range(HEAD_START_ATTEMPTS):
        head = RayNode(ip, resources).start()
        try:
            wait_for_head(head)
            return head
        except HeadExited as exited:
            exits.append(str(exited))
            warnings.warn(f"head start failed: {exited}", stacklevel=2)  # in the run's summary
            head.kill()
        except BaseException:
            head.kill()
            raise
    raise HeadExited("\n---\n".join(exits))


@contextlib.contextmanager
def ray_cluster(
    head_ip: str, head_resources: dict[str, float], nodes: dict[str, dict[str, float]]
) -> Iterator[dict[str, RayNode]]:
    """A head at ``head_ip`` and one node per ``{ip: resources}``, this process connected as
    the driver; every node is killed on the way out, whatever happened."""
    import ray  # this driver joins with the head's address given: no cluster flag needed here

    head = start_head(head_ip, head_resources)
    started: dict[str, RayNode] = {head_ip: head}
    try:
        ray.init(
            address=head.address, _node_ip_address=head_ip, namespace="pdserve", log_to_driver=False
        )
        for ip, resources in nodes.items():  # one at a time: a raylet starting beside another
            started[ip] = RayNode(ip, resources, head_address=head.address).start()
            wait_for_nodes(set(started))  # timed out in startup on 2 cores
        yield started
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        for node in started.values():
            node.kill()
