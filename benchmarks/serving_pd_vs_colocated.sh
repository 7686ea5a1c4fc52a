#!/bin/bash
# `baton bench` against colocated serving (both cores) vs PD (prefill core 0, decode core 1), mixed workload, p99 ITL
cd "$(dirname "$0")/.." && . .venv/bin/activate
mkdir -p benchmarks/results
M=models/baton-stdlib-qwen3
BENCH="baton bench --model baton-stdlib-qwen3 --num-requests 48 --request-rate 3 --prompt-tokens 200:380 --output-tokens 96:128 --count-chunk-tokens --seed 0"
taskset -c 0,1 baton serve --model $M --port 8031 --threads 2 > benchmarks/results/itl_colo_server.log 2>&1 &
S=$!; for i in $(seq 60); do curl -sf http://127.0.0.1:8031/health >/dev/null && break; sleep 1; done
$BENCH --url http://127.0.0.1:8031 --out benchmarks/results/itl_colocated.json --plot benchmarks/results/itl_colocated.png > benchmarks/results/itl_colocated.txt 2>/dev/null
kill -INT $S; wait $S
export BATON_PD_TOKEN=$(python -c "import secrets;print(secrets.token_hex(8))")
taskset -c 0 python -m baton.transfer.worker --role prefill --model $M --port 8041 --token-env BATON_PD_TOKEN --engine num_threads=1 > benchmarks/results/itl_prefill.out 2>benchmarks/results/itl_prefill.log &
P=$!; sleep 8
taskset -c 1 baton serve --role decode --prefill tcp://127.0.0.1:8041 --model $M --port 8032 --threads 1 > benchmarks/results/itl_pd_server.log 2>&1 &
S=$!; for i in $(seq 90); do curl -sf http://127.0.0.1:8032/health >/dev/null && break; sleep 1; done
$BENCH --url http://127.0.0.1:8032 --out benchmarks/results/itl_pd.json --plot benchmarks/results/itl_pd.png > benchmarks/results/itl_pd.txt 2>/dev/null
kill -INT $S; wait $S; kill -TERM $P; wait $P
echo DONE
