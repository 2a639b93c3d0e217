#!/usr/bin/env bash
# Instructions per request on bench-proxy's paths, counted by callgrind (valgrind): the data
# plane's thread, its request path alone, the relay floor's thread and the in-process control
# plane's. Unlike the timings of bench-proxy these do not move with the machine's load, so two
# builds compare exactly; what they leave out is what instructions do not show (the kernel,
# cache misses, `rep movsb` copies counted as one instruction a byte or so).
#
#   tests/bench-instructions.sh            # REQUESTS=5000 by default
#
# Under valgrind a request takes some fifty times as long, while the fleet stream still
# reports every millisecond and the control plane still publishes every two: work done per
# millisecond (reports, backlogs) falls on fewer requests than at full speed, so the threads'
# totals overstate it. The request path's figure (the connection's task, every request's
# pick, dispatch and answer) is per request at any speed.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "needs valgrind: apt-get install -y valgrind" >&2; exit 1; }
requests=${REQUESTS:-5000}
warmup=500
cargo build --release -p continuum-tests --bin bench-proxy
binary=$PWD/target/release/bench-proxy
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
(cd "$out" && valgrind --tool=callgrind --separate-threads=yes "$binary" \
    --requests "$requests" --warmup "$warmup" --rounds 1 >run.log 2>&1)
per=$((requests + warmup))

# The dump of the thread that ran `symbol`.
thread_of() { grep -l "$1" "$out"/callgrind.out.*-* | head -1; }
total() { awk '/^summary:/ {print $2}' "$1"; }
inclusive() { callgrind_annotate --inclusive=yes "$1" 2>/dev/null | grep -F "$2" | head -1 | awk '{gsub(",", "", $1); print $1}'; }

data_plane=$(thread_of 'continuum_data_plane::server::conn::serve')
control_plane=$(thread_of 'backlog::task::run')
floor=$(thread_of 'continuum_tests::relay::read_message')
request_path=$(inclusive "$data_plane" 'continuum_data_plane::server::conn::serve::{{closure}}')

printf '| thread | instructions per request |\n|---|---:|\n'
printf '| data plane (all of it) | %d |\n' $(($(total "$data_plane") / per))
printf '| data plane, the request path alone | %d |\n' $((request_path / per))
printf '| floor: tokio relay | %d |\n' $(($(total "$floor") / per))
printf '| control plane (all of it) | %d |\n' $(($(total "$control_plane") / per))
