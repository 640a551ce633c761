"""``pdserve up`` with security on: an API key, HTTPS and gRPC over TLS on the gateway,
mutual TLS on the KV plane, all from one ``pdserve certs`` directory.

A fresh process starts its own embedded cluster (as a user's ``pdserve up`` does): Serve's
proxy takes its HTTPS options once per cluster, so the shared test cluster cannot show it.
The official ``openai`` client talks to ``https://`` with the deployment's CA, the KV
hand-off crosses the mutual-TLS plane (the decode worker's received blocks count it), plain
HTTP is refused, ``pdserve stats`` reads the gateway with ``--ca-bundle``, and Ctrl-C's
signal stops it although it was started as a script's background job (SIGINT ignored).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import ssl
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from pdserve.deploy.certs import write_certificates
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.proto import generate_pb2, generate_pb2_grpc
from tests.ports import free_port

KEY = "secure-deployment-" + "k" * 16
PROMPT = "The KV plane carries this prompt encrypted: "
START_DEADLINE_S = 240
STOP_DEADLINE_S = 60


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.deploy.cli", *args]


@pytest.mark.ray  # its own embedded cluster, in a process of its own
def test_pdserve_up_with_a_key_https_and_mutual_tls_on_the_kv_plane(tmp_path) -> None:
    certs = write_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    ca = str(certs / "ca.crt")
    trusted = ssl.create_default_context(cafile=ca)
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PDSERVE_API_KEY": KEY}
    # Started as a script's background job is (`pdserve up &`): with SIGINT ignored, which
    # the shell's exec passes on. Ctrl-C's signal must stop it all the same (below).
    command = shlex.join(
        _cli(
            "up",
            "--model", "tiny",
            "--prefill", "1",
            "--decode", "1",
            "--port", str(port),
            "--grpc-port", str(grpc_port),
            "--disagg-min-uncached-tokens", "0",
            "--ssl-certfile", str(certs / "gateway.crt"),
            "--ssl-keyfile", str(certs / "gateway.key"),
            "--kv-tls-dir", str(certs),
        )
    )  # fmt: skip
    up = subprocess.Popen(
        ["bash", "-c", f"trap '' INT; exec {command}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its process group is this test's to stop
    )
    url = f"https://127.0.0.1:{port}"
    try:
        https = httpx.Client(verify=trusted, timeout=30)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            assert up.poll() is None, up.stdout.read()[-3000:]
            try:
                if https.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "pdserve up did not get ready over HTTPS"
            time.sleep(1)

        expected = (
            LLMEngine.from_pretrained("tiny")
            .generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0]
            .text
        )
        client = openai.OpenAI(
            base_url=url + "/v1",
            api_key=KEY,
            http_client=httpx.Client(verify=trusted),
            max_retries=0,
        )
        reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        assert reply.choices[0].text == expected
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=url + "/v1",
                api_key="x",
                http_client=httpx.Client(verify=trusted),
                max_retries=0,
            ).models.list()
        with pytest.raises(httpx.HTTPError):  # plain HTTP: the proxy speaks only TLS
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(url + "/health", timeout=10)

        credentials = grpc.ssl_channel_credentials(open(ca, "rb").read())
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            replies = generate_pb2_grpc.GenerateStub(channel).Generate(
                generate_pb2.GenerateRequest(text=PROMPT, max_tokens=6, temperature=0),
                metadata=(("authorization", f"Bearer {KEY}"),),
                timeout=60,
            )
            assert "".join(r.text for r in replies) == expected

        stats = subprocess.run(
            _cli("stats", "--url", url, "--ca-bundle", ca, "--json"),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stats.returncode == 0, stats.stderr
        workers = {w["worker_id"]: w for w in json.loads(stats.stdout)["workers"]}
        assert workers["decode-0"]["num_blocks_received"] > 0  # pulled over mutual TLS

        up.send_signal(signal.SIGINT)  # pdserve up shuts its cluster down on Ctrl-C
        assert up.wait(timeout=STOP_DEADLINE_S) == 0
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
