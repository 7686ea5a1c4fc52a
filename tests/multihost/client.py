"""The client host of the namespace tests: ``python -m tests.multihost.client JOB.json``.

Runs inside the client's namespace (the test process cannot reach the hosts' addresses),
so every request crosses the bridge. The job names the router, the workers' HTTP URLs, the
served model and the prompts; the admin token comes from ``$BATON_ADMIN_TOKEN``. It waits
until the router lists every worker healthy, then sends each prompt as a greedy completion
through the router with the official ``openai`` client, one after another, scraping every
decode's ``/metrics`` around each (the acceptance histogram's sum and count moved by that
request alone, on the decode that served it). Prints one JSON object: per request the text,
the per-token strings, usage and the acceptance seen; then every worker's final metrics.
"""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 120.0
ACCEPTANCE = "baton_acceptance_length"


def metrics(url: str) -> dict[str, float]:
    """Sample ``name{label=value,...}`` -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def wait_for_workers(router: str, expected: dict[str, list[str]]) -> None:
    """Until ``/admin/instances`` lists exactly ``expected`` (role -> URLs), all healthy."""
    auth = {"authorization": f"Bearer {os.environ['BATON_ADMIN_TOKEN']}"}
    want = {(role, url) for role, urls in expected.items() for url in urls}
    deadline = time.monotonic() + READY_TIMEOUT_S
    listed: object = None
    while time.monotonic() < deadline:
        try:
            listed = httpx.get(f"{router}/admin/instances", headers=auth, timeout=5).json()
            healthy = {(i["role"], i["url"]) for i in listed["instances"] if i["healthy"]}
            if healthy == want:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the router never listed {sorted(want)} healthy; last: {listed}")


def completion(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0
    )
    choice = resp.choices[0]
    return {
        "text": choice.text,
        "tokens": choice.logprobs.tokens,
        "completion_tokens": resp.usage.completion_tokens,
        "prompt_tokens": resp.usage.prompt_tokens,
    }


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    router, decodes, prefills = job["router"], job["decodes"], job["prefills"]
    wait_for_workers(router, {"prefill": prefills, "decode": decodes})
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=60)
    results = []
    for prompt in job["prompts"]:
        before = {url: metrics(url) for url in decodes}
        result = completion(client, job["model"], prompt, job["max_tokens"])
        after = {url: metrics(url) for url in decodes}
        served = [
            u
            for u in decodes
            if after[u][f"{ACCEPTANCE}_count{{}}"] > before[u].get(f"{ACCEPTANCE}_count{{}}", 0.0)
        ]
        assert len(served) == 1, f"the acceptance of one request moved on {served}"
        moved = after[served[0]][f"{ACCEPTANCE}_sum{{}}"] - before[served[0]].get(
            f"{ACCEPTANCE}_sum{{}}", 0.0
        )
        results.append({**result, "decode": served[0], "acceptance_length": moved})
    final = {url: metrics(url) for url in [*decodes, *prefills]}
    print(json.dumps({"requests": results, "metrics": final}))


if __name__ == "__main__":
    main()
