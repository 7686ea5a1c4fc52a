#!/bin/bash
# `baton bench` against colocated serving (both cores) vs PD through `baton launch` (router +
# prefill pinned to core 0 + decode pinned to core 1, shm), same mixed workload; compare p99 ITL.
cd "$(dirname "$0")/.." && . .venv/bin/activate
mkdir -p benchmarks/results
M=models/baton-stdlib-qwen3
# the router's admin token (launch uses it; bench reads it to find the workers' /metrics)
export BATON_ADMIN_TOKEN="$(python -c 'import secrets; print(secrets.token_hex(16))')"
BENCH="baton bench --model baton-stdlib-qwen3 --num-requests 48 --request-rate 3 --prompt-tokens 200:380 --output-tokens 96:128 --count-chunk-tokens --seed 0 --no-progress"
wait_up() { for i in $(seq 120); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }

taskset -c 0,1 baton serve --model $M --port 8031 --threads 2 > benchmarks/results/itl_colo_server.log 2>&1 &
S=$!; wait_up http://127.0.0.1:8031
$BENCH --url http://127.0.0.1:8031 --out benchmarks/results/itl_colocated.json --plot benchmarks/results/itl_colocated.png > benchmarks/results/itl_colocated.txt
kill -INT $S; wait $S

baton launch --model $M --port 8032 --threads 1 --prefill-cpus 0 --decode-cpus 1 > benchmarks/results/itl_pd_launch.log 2>&1 &
L=$!; wait_up http://127.0.0.1:8032
$BENCH --url http://127.0.0.1:8032 --out benchmarks/results/itl_pd.json --plot benchmarks/results/itl_pd.png > benchmarks/results/itl_pd.txt
kill -INT $L; wait $L
python - <<'PY'
import json
c, p = (json.load(open(f"benchmarks/results/itl_{n}.json"))["summary"] for n in ("colocated", "pd"))
for key in ("itl_token_s", "itl_chunk_s", "tpot_s", "ttft_s", "e2e_s"):
    print(f"{key:12} p50 {c[key]['p50']*1e3:7.1f} vs {p[key]['p50']*1e3:7.1f} ms   "
          f"p99 {c[key]['p99']*1e3:7.1f} vs {p[key]['p99']*1e3:7.1f} ms   "
          f"(PD/colocated p99 {p[key]['p99']/c[key]['p99']:.2f}x)")
print(f"throughput {c['request_throughput']:.2f} vs {p['request_throughput']:.2f} req/s; "
      f"acceptance {c.get('acceptance_length_mean')} vs {p.get('acceptance_length_mean')}; "
      f"PD transfer {p.get('transfer_gb_per_s')} GB/s over {p.get('transfer_bytes')} B")
PY
echo DONE
