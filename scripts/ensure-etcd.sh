#!/usr/bin/env bash
# Make sure an `etcd` server binary is on PATH; install Debian's etcd-server and etcd-client
# with apt when it is not. Idempotent: does nothing when etcd is already there. Tests and
# `lbd dev up` run their own etcd on free ports, so a packaged etcd service does not get in the way.
set -euo pipefail

if command -v etcd >/dev/null 2>&1; then
    echo "etcd found: $(command -v etcd)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "etcd not found and apt-get is unavailable: install etcd (3.4 or newer) so that" \
        "\`etcd\` is on PATH" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "etcd not found: run as root or install sudo to let this script install etcd-server" >&2
    exit 1
fi

echo "etcd not found: installing etcd-server and etcd-client with apt"
"${SUDO[@]}" apt-get update
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    etcd-server etcd-client

command -v etcd >/dev/null 2>&1 || { echo "etcd-server installed but etcd is not on PATH" >&2; exit 1; }
echo "etcd installed: $(command -v etcd)"
