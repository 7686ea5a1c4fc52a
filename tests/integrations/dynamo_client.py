"""The client host of the Dynamo namespace tests: ``python -m tests.integrations.dynamo_client
JOB.json``.

Runs in the client's namespace (the test process cannot reach the hosts' addresses). The job
names the frontend, the model and the prompts. It waits until a greedy one-token completion
through the frontend succeeds (workers registered, a PD pair able to serve), then sends the
prompts as greedy completions with the official ``openai`` client, ``concurrency`` at a time,
and prints one JSON object: per prompt the text, usage and seconds, in the job's order.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

READY_TIMEOUT_S = 120.0


def wait_ready(client: openai.OpenAI, model: str) -> float:
    """Seconds until a one-token completion succeeded; exits saying the last error if none
    did in ``READY_TIMEOUT_S``."""
    start = time.monotonic()
    last: object = None
    while time.monotonic() - start < READY_TIMEOUT_S:
        try:
            client.completions.create(model=model, prompt="def", max_tokens=1, temperature=0)
            return time.monotonic() - start
        except openai.OpenAIError as exc:
            last = exc
            time.sleep(0.5)
    raise SystemExit(f"the frontend never served {model}; last: {last!r}")


def completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.monotonic()
    try:
        resp = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "error": str(exc), "seconds": time.monotonic() - start}
    except openai.OpenAIError as exc:
        return {"status": None, "error": repr(exc), "seconds": time.monotonic() - start}
    usage = resp.usage.model_dump() if resp.usage else {}
    return {
        "status": 200,
        "id": resp.id.removeprefix("cmpl-"),  # the request id the workers' log lines name
        "text": resp.choices[0].text,
        "finish_reason": resp.choices[0].finish_reason,
        "usage": usage,
        "seconds": time.monotonic() - start,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    client = openai.OpenAI(base_url=f"{job['frontend']}/v1", api_key="none", max_retries=0)
    ready_s = wait_ready(client, job["model"]) if job.get("wait", True) else 0.0
    with ThreadPoolExecutor(job.get("concurrency", 1)) as pool:
        results = list(
            pool.map(
                lambda p: completion(client, job["model"], p, job["max_tokens"]), job["prompts"]
            )
        )
    print(json.dumps({"ready_s": ready_s, "results": results}))


if __name__ == "__main__":
    main()
