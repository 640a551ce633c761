"""LoRA adapters through the service (1 prefill + 1 decode over gRPC): a request names an
adapter as its ``model``; rows of different adapters and of the base run together and each
equals the colocated engine with the same adapters (which ``tests/engine/test_lora.py``
holds equal to transformers + peft); adapters load and unload at run time on every worker
or on none; a decode worker that lacks an adapter reads it from the path the request brings,
or, not allowed to, fails the request naming it, holding nothing after.

The base is a random Llama and the adapters are written by peft (``write_folders``).
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from bench.load_driver import get_json, wait_until_drained
from pdserve.deploy.cluster import auth_headers, base_url
from pdserve.engine.llm_engine import LLMEngine
from pdserve.messages.sampling_params import SamplingParams
from tests.engine.test_lora import write_folders
from tests.service.browser import headless_chromium
from tests.service.service_apps import (
    expected_text,
    on_worker,
    post_completion,
    running_app,
    wait_until_ready,
    worker_rows,
)

PROMPTS = ["w5 w9 w2 w17 w30 w4 w11", "w6 w7 w8 w9 w10 w12 w14 w20 w21", "w1 w2 w3", "w29 w28"]
NAMES = ["qv", None, "everything", "qv"]
SAMPLINGS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, seed=11)}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return write_folders(tmp_path_factory)


@pytest.fixture(scope="module")
def service(ray_cluster, folders):
    base, adapters = folders
    modules = {name: str(adapters[name]) for name in ("qv", "everything")}
    with running_app(
        model=str(base), num_prefill=1, num_decode=1, lora_modules=modules, num_kv_blocks=64
    ) as config:
        wait_until_ready(config)
        yield config


@pytest.fixture(scope="module")
def reference(folders):
    """The colocated engine with every adapter, each under its own name."""
    base, adapters = folders
    return LLMEngine.from_pretrained(
        str(base), lora_modules={n: str(p) for n, p in adapters.items()}, num_kv_blocks=64
    )


def complete(service, model: str | None, prompt: str, sampling: dict) -> tuple[int, dict]:
    body = {"model": model or service.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS}
    status, _, answer = post_completion(service, {**body, "ignore_eos": True, **sampling})
    return status, answer


def expected(reference: LLMEngine, name: str | None, prompt: str, sampling: dict) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    if name is None:
        return expected_text(reference, prompt, params)
    [output] = reference.generate([reference.tokenizer.encode(prompt)], params, lora_names=[name])
    return reference.tokenizer.decode(output.output_token_ids)


def registered_digest(service, worker_id: str, name: str) -> str:
    return on_worker(service, worker_id, lambda worker: worker.engine.lora.registered[name].digest)


def post_admin(service, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        base_url(service) + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **auth_headers(service)},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_models_lists_each_adapter_with_the_base_as_its_parent(service, folders):
    _, adapters = folders
    listed = {entry["id"]: entry for entry in get_json(service, "/v1/models")["data"]}
    assert list(listed) == [service.model_name, "everything", "qv"]
    assert listed[service.model_name]["parent"] is None
    assert listed["qv"]["parent"] == service.model_name
    assert listed["qv"]["root"] == str(adapters["qv"])


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_adapters_and_the_base_in_flight_together_equal_colocated(service, reference, sampling):
    answers: dict[int, tuple[int, dict]] = {}

    def send(index: int) -> None:
        answers[index] = complete(service, NAMES[index], PROMPTS[index], sampling)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, (prompt, name) in enumerate(zip(PROMPTS, NAMES)):
        status, answer = answers[index]
        assert status == 200, answer
        assert answer["model"] == (name or service.model_name)
        assert answer["choices"][0]["text"] == expected(reference, name, prompt, sampling), name
    counts = get_json(service, "/stats")["gateway"]["lora_requests"]
    assert counts["qv"] >= 2 and counts["everything"] >= 1
    for row in worker_rows(service).values():
        assert row["lora_adapters_resident"] == {"qv": 1, "everything": 1}
        assert row["lora_requests"]["qv"] >= 2
    metrics = urllib.request.urlopen(
        urllib.request.Request(base_url(service) + "/metrics", headers=auth_headers(service))
    ).read()
    assert b'pdserve:gateway_lora_requests_total{lora_name="qv"' in metrics


def test_the_dashboard_shows_each_workers_adapters_and_their_requests(service):
    with headless_chromium() as driver:
        from selenium.webdriver.support.ui import WebDriverWait  # after the skip without it

        driver.get(base_url(service) + "/dashboard")
        WebDriverWait(driver, 30).until(
            lambda d: d.execute_script("return window.pdserveDashboard.updates >= 1")
        )
        cells = [
            row.find_elements("css selector", "td")[-1].text
            for row in driver.find_elements("css selector", "#workers tbody tr")
        ]
    assert len(cells) == 2
    for cell in cells:  # "everything (n), qv (m)": both held, each with its requests
        assert re.fullmatch(r"everything \(\d+\), qv \([1-9]\d*\)", cell), cell


def test_a_run_time_load_reaches_every_worker_and_new_weights_never_meet_old_blocks(
    service, reference, folders
):
    _, adapters = folders
    greedy = SAMPLINGS["greedy"]
    prompt = PROMPTS[1]
    status, text = post_admin(
        service, "/v1/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
    )
    assert status == 200 and "'mlp' added" in text
    status, answer = complete(service, "mlp", prompt, greedy)
    assert status == 200 and answer["choices"][0]["text"] == expected(
        reference, "mlp", prompt, greedy
    )
    assert all(row["lora_adapters_resident"].get("mlp") for row in worker_rows(service).values())
    first_digests = {w: registered_digest(service, w, "mlp") for w in ("prefill-0", "decode-0")}
    assert len(set(first_digests.values())) == 1  # one file, one digest, no coordination

    assert post_admin(service, "/v1/unload_lora_adapter", {"lora_name": "mlp"})[0] == 200
    status, answer = complete(service, "mlp", prompt, greedy)
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    assert "mlp" not in {e["id"] for e in get_json(service, "/v1/models")["data"]}
    # "mlp" again, over other weights: the same prompt's blocks under the old "mlp" are
    # cached on both workers, and the answer is the new weights', from none of them.
    body = {"lora_name": "mlp", "lora_path": str(adapters["everything"])}
    assert post_admin(service, "/v1/load_lora_adapter", body)[0] == 200
    status, answer = complete(service, "mlp", prompt, greedy)
    assert status == 200
    assert answer["choices"][0]["text"] == expected(reference, "everything", prompt, greedy)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert registered_digest(service, "decode-0", "mlp") != first_digests["decode-0"]
    assert post_admin(service, "/v1/unload_lora_adapter", {"lora_name": "mlp"})[0] == 200


def test_a_load_one_worker_refuses_leaves_no_worker_with_the_adapter(service, folders):
    _, adapters = folders

    def set_max_rank(rank: int):
        def install(worker) -> None:
            worker.engine.lora.max_rank = rank

        return install

    on_worker(service, "decode-0", set_max_rank(4))
    try:
        body = {"lora_name": "wide", "lora_path": str(adapters["everything"])}  # rank 8
        status, text = post_admin(service, "/v1/load_lora_adapter", body)
    finally:
        on_worker(service, "decode-0", set_max_rank(16))
    assert status == 400
    message = json.loads(text)["error"]["message"]
    assert "decode-0: LoRA adapter 'wide' has rank 8" in message and "prefill-0" not in message
    for worker_id in ("prefill-0", "decode-0"):
        names = on_worker(service, worker_id, lambda worker: worker.engine.lora.names())
        assert names == ["everything", "qv"], worker_id
    assert "wide" not in {e["id"] for e in get_json(service, "/v1/models")["data"]}


def test_a_decode_worker_without_the_adapter_loads_it_or_refuses_naming_it(service, reference):
    """The decode worker forgets "qv" (as one started before a load would lack it): not
    allowed to load on demand, the request fails naming the adapter and nothing stays
    leased; allowed, it reads the folder the request brings and decodes as colocated."""

    def forget_qv(on_demand: bool):
        def install(worker) -> None:
            worker.engine.lora.unload("qv")
            worker.engine.lora.load_on_demand = on_demand

        return install

    greedy = SAMPLINGS["greedy"]
    on_worker(service, "decode-0", forget_qv(False))
    status, answer = complete(service, "qv", PROMPTS[2], greedy)
    assert status >= 400 and "LoRA adapter 'qv'" in answer["error"]["message"], answer
    wait_until_drained(service)
    assert all(row["num_leases_held"] == 0 for row in worker_rows(service).values())

    def allow(worker) -> None:
        worker.engine.lora.load_on_demand = True

    on_worker(service, "decode-0", allow)
    status, answer = complete(service, "qv", PROMPTS[3], greedy)
    assert status == 200
    assert answer["choices"][0]["text"] == expected(reference, "qv", PROMPTS[3], greedy)
    assert "qv" in on_worker(service, "decode-0", lambda worker: worker.engine.lora.names())


@pytest.mark.parametrize(
    "path, body, status, says",
    [
        ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404, "model 'nope' does not"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "'lora_path' must be"),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}, 400, "read"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "'nope' is not loaded"),
    ],
    ids=["unknown model", "no path", "no folder", "unload unknown"],
)
def test_bad_adapter_input_is_refused_in_openais_shape(service, path, body, status, says):
    got, text = post_admin(service, path, {"max_tokens": 2, **body})
    assert got == status, text
    assert says in json.loads(text)["error"]["message"]


def test_every_choice_of_an_n_request_runs_the_adapter(service, reference):
    """``n`` = 2 under an adapter: the second choice runs where the first streams from, as
    a sibling, with the next seed; both equal the reference under that adapter."""
    body = {"model": "everything", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "n": 2}
    status, _, answer = post_completion(
        service, {**body, "ignore_eos": True, "temperature": 0.8, "seed": 21}
    )
    assert status == 200, answer
    texts = [choice["text"] for choice in sorted(answer["choices"], key=lambda c: c["index"])]
    assert texts == [
        expected(reference, "everything", PROMPTS[0], {"temperature": 0.8, "seed": seed})
        for seed in (21, 22)
    ]
