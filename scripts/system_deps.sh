#!/usr/bin/env bash
# The Debian libraries Mooncake Store loads even over TCP (its Python extension and
# mooncake_master): libibverbs1, libnuma1, libcurl4, and librdmacm1 for RDMA. The
# Mooncake tier's tests run a real cluster, so `make test` installs them when it runs
# as root with apt-get (CI does); otherwise it says exactly what is missing and the
# tests skip naming it. On CI (CI=true) a library still missing is an error.
set -euo pipefail

libs=(libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4)

missing() {
    local pair
    local found
    found=$(ldconfig -p 2>/dev/null || true)
    for pair in "${libs[@]}"; do
        grep -q "${pair%%:*}" <<<"$found" || printf '%s\n' "${pair##*:}"
    done
}

mapfile -t need < <(missing)
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "system_deps: installing ${need[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    mapfile -t need < <(missing)
    [ ${#need[@]} -eq 0 ] && exit 0
fi

echo "system_deps: missing Debian packages for the Mooncake tier's tests: ${need[*]}" >&2
echo "system_deps: install them as root: apt-get install -y ${need[*]}" >&2
if [ "${CI:-}" = "true" ]; then
    exit 1
fi
echo "system_deps: the Mooncake cluster tests will be skipped, naming them" >&2
