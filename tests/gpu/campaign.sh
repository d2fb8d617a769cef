#!/usr/bin/env bash
# The GPU campaign in one device command (docs/gpu-verification.md says what it records).
#
#   OUT=DIR bash tests/gpu/campaign.sh COMMIT            # the GPU suite, file by file
#   OUT=DIR bash tests/gpu/campaign.sh COMMIT bench      # the benchmarks, JSON under perf/
#
# COMMIT names the code in every record (the copy on a device has no git history). Run from the
# repository root with the wheels carried in .whl/ (tests/gpu/device-setup.sh installs them and
# builds the shim). Environment:
#   FILES     the suite's files (or bench parts) to run, by name, space-separated, in that order
#             (default: all, the quick and most owed ones first; names as `campaign.sh - list`)
#   BUDGET_S  seconds after which no new file starts (default 540: one 600 s device command);
#             a file whose usual time no longer fits is not started; the summary names those
#   SETUP=0   skip tests/gpu/device-setup.sh (a warm machine where an earlier call ran it)
# Writes environment.txt, logs/<file>.log (the scheduler's own log lines dropped, gzipped over
# 8 MiB), junit/<file>.xml, summary.txt, packed as $OUT/campaign.tar.gz; unpacked into a folder,
# `python3 tests/gpu/record.py FOLDER` turns them into a section of docs/gpu-verification.md. Exits 1 when a file failed or timed out;
# without a GPU it runs nothing, says "no GPU" in the summary and exits 0.
set -uo pipefail

# name, usual seconds on an H100 (the suite: docs/gpu-verification.md 2026-11-28 (c); the bench
# parts: the 2026-11-27 logs; launch, train, replay and replay_real: bench/run_campaign.py's
# estimates)
SUITE="
test_gpu_card.py 300
test_gpu_captures.py 55
test_gpu_reliability.py 115
test_gpu_memory_engine.py 190
test_jupyter_gpu.py 60
test_wait_line_gpu.py 50
test_gpu_nvml_claims.py 30
test_gpu_reserves.py 20
test_metrics_gpu.py 20
test_device_plugin_gpu.py 20
test_gpu.py 180
test_gpu_deep_idle.py 120
test_gpu_deep_idle_service_account.py 25
test_mps.py 100
test_gpu_programs.py 330
test_multi_gpu.py 150
"
BENCH="
cold_eviction 150
handoff 250
train_beside 260
kernel_start 80
nbmix_replay 470
launch 90
train 120
replay 470
replay_real 500
"

commit=${1:?usage: OUT=DIR bash tests/gpu/campaign.sh COMMIT [bench]}
mode=${2:-suite}
if [ "$commit" = - ]; then  # campaign.sh - list: the names FILES takes
    echo "suite: $(echo "$SUITE" | awk 'NF {print $1}' | xargs)"
    echo "bench: $(echo "$BENCH" | awk 'NF {print $1}' | xargs)"
    exit 0
fi
: "${OUT:?set OUT to the directory that comes back}"
# The device tool brings back at most 8 files from $OUT: everything is written to a work folder
# and packed into $OUT/campaign.tar.gz (summary.txt and environment.txt also beside it) on exit,
# also when a file's timeout or the command's own limit cuts the run short.
result=$OUT
OUT=$(mktemp -d /tmp/gpushare-campaign.XXXXXX)
pack() {
    mkdir -p "$result"
    tar -czf "$result/campaign.tar.gz" -C "$OUT" . 2>/dev/null
    cp -f "$OUT/summary.txt" "$OUT/environment.txt" "$result/" 2>/dev/null || true
}
trap pack EXIT
budget=${BUDGET_S:-540}
deadline=$((SECONDS + budget))
mkdir -p "$OUT/logs" "$OUT/junit" "$OUT/perf"
summary=$OUT/summary.txt

gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ')
{
    echo "# commit: $commit"
    echo "# mode: $mode"
    echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# gpus: $gpus"
    echo "# budget_s: $budget"
    [ -n "${FILES:-}" ] && echo "# files: $FILES"
} > "$summary"
{
    sed 's/^# //' "$summary"
    echo "host: $(uname -n) ($(nproc) CPUs)"
    if [ "$gpus" -gt 0 ]; then
        nvidia-smi -q 2>&1 | sed -n '1,12p'
        nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
    fi
} > "$OUT/environment.txt"

if [ "$mode" = bench ]; then table=$BENCH; else table=$SUITE; fi
if [ "$mode" = suite ]; then  # gpu-marked tests outside tests/gpu run too, after the suite
    while read -r f; do
        table+=$'\n'"$f 120"
    done < <(grep -rlE 'pytest\.mark\.gpu|pytestmark.*gpu' tests --include='test_*.py' | grep -v '^tests/gpu/')
fi
names=${FILES:-$(echo "$table" | awk 'NF {print $1}')}

if [ "$gpus" -eq 0 ]; then
    echo "# result: no GPU (nvidia-smi lists none): nothing run" >> "$summary"
    printf 'file\tstatus\tpassed\tfailed\terrors\tskipped\tseconds\trc\n' >> "$summary"
    for n in $names; do printf '%s\tnot run: no GPU\t0\t0\t0\t0\t0\t-\n' "$n" >> "$summary"; done
    cat "$summary"
    exit 0
fi

if [ "${SETUP:-1}" != 0 ]; then
    # shellcheck source=tests/gpu/device-setup.sh
    if ! . tests/gpu/device-setup.sh "$commit" > "$OUT/logs/setup.log" 2>&1; then
        echo "# result: setup failed (logs/setup.log)" >> "$summary"
        tail -n 20 "$OUT/logs/setup.log"
        cat "$summary"
        exit 1
    fi
else
    export PYTHONPATH=/tmp/site GPUSHARE_BENCH_COMMIT=$commit PYTHONUNBUFFERED=1
fi
python3 tests/gpu/record.py env >> "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# GPU processes there before the campaign; a file cut short may leave its own behind
baseline=" $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ') "
reap() {
    local pid
    for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
        case $baseline in *" $pid "*) ;; *) kill -9 "$pid" 2>/dev/null && echo "killed GPU process $pid left behind" ;; esac
    done
}

run_one() {  # NAME TIMEOUT BASE: one file or bench part into logs/BASE.raw and junit/BASE.xml
    local n=$1 limit=$2 path junit=$OUT/junit/$3.xml raw=$OUT/logs/$3.raw
    case $mode:$n in
        suite:*/*) path=$n ;;
        suite:*) path=tests/gpu/$n ;;
    esac
    case $mode:$n in
        suite:test_device_plugin_gpu.py)
            if ! python3 -c 'import jupyter_gpushare.deviceplugin.v1beta1.api_pb2_grpc' > "$raw" 2>&1; then
                echo "not run: grpc not importable ($(tail -n 1 "$raw")); carry grpcio>=1.85.1 and protobuf 7 wheels" > "$raw"
                return 200
            fi ;;
    esac
    case $mode:$n in
        suite:*) timeout -k 15 "$limit" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
                    --junitxml="$junit" "$path" > "$raw" 2>&1 ;;
        bench:cold_eviction) timeout -k 15 "$limit" python3 -m bench.cold_eviction \
                    --out "$OUT/perf/cold_eviction.json" --repeats 2 \
                    --workdir /tmp/bench-work/cold_eviction > "$raw" 2>&1 ;;
        bench:handoff) timeout -k 15 "$limit" python3 -m bench.run_campaign "$OUT/perf" \
                    --only handoff --handoffs 200 --handoff-sizes 4,16,20 \
                    --arrival-gib 12 --arrival-idle 3 > "$raw" 2>&1 ;;
        bench:train_beside) timeout -k 15 "$limit" python3 -m bench.train_beside "$OUT/perf" \
                    --duration 60 > "$raw" 2>&1 ;;
        bench:kernel_start) timeout -k 15 "$limit" python3 -m bench.run_campaign "$OUT/perf" \
                    --only kernel_start --kernel-pairs 12 > "$raw" 2>&1 ;;
        bench:nbmix_replay) timeout -k 15 "$limit" python3 -m bench.run_campaign "$OUT/perf" \
                    --only nbmix-replay > "$raw" 2>&1 ;;
        bench:replay) timeout -k 15 "$limit" python3 -m bench.run_campaign "$OUT/perf" \
                    --only replay > "$raw" 2>&1 ;;
        bench:replay_real) timeout -k 15 "$limit" python3 -m bench.run_campaign "$OUT/perf" \
                    --only replay-real > "$raw" 2>&1 ;;
        bench:launch | bench:train) timeout -k 15 "$limit" python3 -m bench.run_campaign \
                    "$OUT/perf" --only "$n" > "$raw" 2>&1 ;;
        *) echo "unknown $mode part: $n" > "$raw"; return 201 ;;
    esac
}

# rows go into the summary as files end: a command cut short still brings back what it finished
printf 'file\tstatus\tpassed\tfailed\terrors\tskipped\tseconds\trc\n' >> "$summary"
notrun=""
failed=""
for n in $names; do
    est=$(echo "$table" | awk -v n="$n" '$1 == n {print $2}')
    if [ -z "$est" ]; then
        printf '%s\tnot run: unknown name\t0\t0\t0\t0\t0\t-\n' "$n" >> "$summary"
        continue
    fi
    left=$((deadline - SECONDS))
    if [ "$left" -le 0 ] || [ "$est" -gt "$left" ]; then
        printf '%s\tnot run: budget (%ss usual, %ss left)\t0\t0\t0\t0\t0\t-\n' "$n" "$est" "$left" >> "$summary"
        notrun+=" $n"
        continue
    fi
    limit=$((est * 2 > left + 30 ? left + 30 : est * 2))
    [ "$limit" -lt 60 ] && limit=60
    echo "=== $n (usual ${est}s, limit ${limit}s, ${left}s of budget left)"
    base=${n%.py}
    base=${base//\//_}
    t0=$SECONDS
    run_one "$n" "$limit" "$base"
    rc=$?
    secs=$((SECONDS - t0))
    log=$OUT/logs/$base.log
    # the scheduler's own log lines out (each test prints its scheduler's log), test ids kept;
    # for a file that failed they are kept apart, gzipped, to find out why
    if [ "$rc" != 0 ]; then
        grep -aE 'SchedulerApp\]' "$OUT/logs/$base.raw" | gzip > "$OUT/logs/$base.scheduler.log.gz"
    fi
    sed -E '/^\[[A-Z] [0-9:.]+ SchedulerApp\]/d; s/ ?\[[A-Z] [0-9:.]+ SchedulerApp\].*$//' \
        "$OUT/logs/$base.raw" > "$log"
    rm -f "$OUT/logs/$base.raw"
    case $rc in 124 | 137) status="timeout after ${limit}s"; reap ;; 200) status=$(head -n 1 "$log") ;; *) status=rc ;; esac
    python3 tests/gpu/record.py row "$n" "$OUT/junit/$base.xml" "$rc" "$secs" "$status" "$log" >> "$summary"
    tail -n 1 "$summary"
    case $(tail -n 1 "$summary" | cut -f 2) in failed* | timeout* | no\ tests*) failed+=" $n" ;; esac
    grep -aE '^(FAILED|ERROR) |^=+ .* in [0-9.]+s' "$log" | tail -n 12
    if [ "$(stat -c %s "$log")" -gt $((8 << 20)) ]; then gzip -f "$log"; fi
done
if [ -n "$notrun" ]; then
    echo "# not run (budget):$notrun" >> "$summary"
    echo "# next: FILES=\"${notrun# }\" (SETUP=0 on the same warm machine)" >> "$summary"
fi
if [ "$mode" = bench ] && [ $((deadline + 30 - SECONDS)) -ge 20 ]; then  # the records as pages
    timeout $((deadline + 30 - SECONDS)) python3 -m bench.report "$OUT/perf" > "$OUT/logs/report.log" 2>&1 ||
        echo "bench.report failed: logs/report.log"
fi
[ -n "$failed" ] && echo "# failed:$failed" >> "$summary"
echo "# total_s: $SECONDS" >> "$summary"
echo "=== summary"
cat "$summary"
[ -z "$failed" ]  # the exit status: 1 when a file failed or timed out (not for files left out)
