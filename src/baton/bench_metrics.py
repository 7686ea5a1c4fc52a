"""``baton bench``'s view of the servers: their Prometheus ``/metrics`` before and after a run.

``scrape`` reads one server's counters, gauges and histogram sums/counts; ``workers_of``
finds the workers behind a baton router (its ``/admin/instances``) or takes them from
``--metrics-url``; ``metrics_delta`` diffs two scrapes; ``engine_summary`` turns the diffs
into the acceptance length and the PD transfer rate of the run.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from baton.config import ADMIN_TOKEN_ENV, read_secret_env


async def workers_of(
    client: httpx.AsyncClient, metrics_urls: Iterable[str] = (), admin_token: str | None = None
) -> list[str]:
    """The servers whose metrics to diff besides ``client``'s base URL: ``metrics_urls``
    and, when that URL is a baton router that lists them, its instances (with the bearer
    token ``admin_token``, else ``$BATON_ADMIN_TOKEN``)."""
    urls = list(metrics_urls)
    token = admin_token or read_secret_env(ADMIN_TOKEN_ENV)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        resp = await client.get("/admin/instances", headers=headers)
        if resp.status_code == 200:
            urls += [i["url"] for i in resp.json()["instances"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return list(dict.fromkeys(u.rstrip("/") for u in urls))


async def scrape(client: httpx.AsyncClient, url: str = "") -> dict[str, float]:
    """Counter, gauge and histogram sum/count samples of ``/metrics``; {} when unavailable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get(f"{url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def engine_summary(deltas: list[dict[str, float]]) -> dict[str, float | None]:
    """Acceptance length and transfer rate over the run, from the servers' metric deltas
    (transfer counted where it lands: decode servers' ``baton_transfer_*``)."""
    accepted = sum(d.get("baton_acceptance_length_sum", 0.0) for d in deltas)
    verified = sum(d.get("baton_acceptance_length_count", 0.0) for d in deltas)
    decodes = [d for d in deltas if "baton_acceptance_length_count" in d]
    moved = sum(
        v for d in decodes for k, v in d.items() if k.startswith("baton_transfer_bytes_total")
    )
    seconds = sum(d.get("baton_transfer_push_seconds_total", 0.0) for d in decodes)
    return {
        "acceptance_length_mean": accepted / verified if verified else None,
        "transfer_bytes": moved,
        "transfer_gb_per_s": moved / seconds / 1e9 if seconds else None,
    }


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if not k.startswith("baton_num_")}
    for name in ("time_to_first_token", "inter_token_latency"):
        total, count = (delta.get(f"baton_{name}_seconds_{s}") for s in ("sum", "count"))
        if total is not None and count:
            delta[f"server_mean_{name}_s"] = total / count
    return delta
