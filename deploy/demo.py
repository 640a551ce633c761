"""``pdserve demo``: a 1 + 1 deployment answers real questions that share a long system prompt.

    up (embedded Ray on loopback) ─▶ one warm-up question ─▶ the rest, concurrently
    ─▶ answers and the stats table (prefix hits, KV blocks moved, dedup) ─▶ down

The shared system prompt spans many KV blocks: after the warm-up, each question's prefill
hits it in the prefill worker's cache, and the decode worker already holds it, so only
each question's own blocks move. With the built-in ``smollm2`` the answers are real text;
with ``tiny`` (random weights) they are noise, but the blocks move the same way.
"""

from __future__ import annotations

import concurrent.futures
import time

from pdserve.deploy.config import PDServeConfig
from pdserve.deploy.http_client import ServiceClient
from pdserve.deploy.stats_table import format_stats

SYSTEM_PROMPT = (
    "You are a concise assistant for a team that runs large language model services. "
    "Answer in one or two short sentences, plainly, without lists or headings. "
    "If a question is about geography, name the place directly. If it is about computing, "
    "explain the idea the way you would to a new colleague on their first day. "
    "Never invent numbers; when you are unsure, say so briefly."
)
QUESTIONS = [
    "What is the capital of France?",
    "What is a KV cache in a transformer?",
    "Why would a service run prefill and decode on different machines?",
    "What is the largest ocean on Earth?",
    "What does a cache hit mean?",
]
MAX_TOKENS = 48


def run_demo(config: PDServeConfig) -> int:
    """Exit status 0 when every question was answered."""
    from pdserve.deploy.cluster import base_url, deploy, init_ray, shut_down

    start = time.perf_counter()
    init_ray(config.ray_address, num_cpus=2)
    print(
        f"starting {config.num_prefill} prefill + {config.num_decode} decode workers of "
        f"{config.model_name!r} ..."
    )
    print(f"up in {deploy(config):.1f}s")
    keys = config.resolve_api_keys().api_key  # the deployment's, when it has any
    client = ServiceClient(base_url(config), api_key=keys[0] if keys else None)

    def ask(question: str) -> str:
        body = {
            "model": config.model_name,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
        }
        return client.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]

    try:
        answers = [ask(QUESTIONS[0])]  # warms the shared system prompt's blocks
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers += pool.map(ask, QUESTIONS[1:])
        for question, answer in zip(QUESTIONS, answers):
            print(f"\nQ: {question}\nA: {answer.strip()}")
        time.sleep(0.5)  # let the routers' event polls settle
        print()
        print(format_stats(client.get("/stats")))
    finally:
        client.close()
        shut_down(config)
    print(f"demo done in {time.perf_counter() - start:.1f}s")
    return 0
