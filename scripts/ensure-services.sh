#!/usr/bin/env bash
# Make sure the real peers the test suite talks to are up: PostgreSQL and Redis on
# 127.0.0.1, and the prometheus, pushgateway, alertmanager, victoria-metrics, chromium and
# docker-compose binaries (docker-compose only validates the compose file; no daemon). Starts
# or installs whatever is missing.
set -euo pipefail

apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then
        apt-get update -qq >/dev/null
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

wait_for() {  # wait_for NAME COMMAND...
    local name=$1; shift
    for _ in $(seq 1 60); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.5
    done
    echo "ensure-services: $name did not come up" >&2
    return 1
}

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    command -v pg_ctlcluster >/dev/null || apt_install postgresql
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    wait_for PostgreSQL pg_isready -q -h 127.0.0.1 -p 5432
fi

if ! redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
    command -v redis-server >/dev/null || apt_install redis-server
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
        --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for Redis sh -c 'redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG'
fi

# the real peers of the exposition, Grafana-query and browser tests
missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v prometheus-pushgateway >/dev/null || missing+=(prometheus-pushgateway)
command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)
command -v victoria-metrics >/dev/null || missing+=(victoria-metrics)  # bench/scale.py's anchor
command -v chromium >/dev/null || missing+=(chromium fonts-dejavu-core)
if [ "${#missing[@]}" -gt 0 ]; then apt_install "${missing[@]}"; fi
# docker-compose validates docker-compose.yml (`config`): no Docker engine needed
command -v docker-compose >/dev/null || apt_install --no-install-recommends docker-compose
echo "ensure-services: PostgreSQL, Redis, prometheus, pushgateway, alertmanager, victoria-metrics, chromium and docker-compose are ready"
