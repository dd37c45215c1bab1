#!/usr/bin/env bash
# Installs and starts a Docker engine with the Compose v2 plugin on a Debian
# bookworm machine (what CI and the dev machines are); idempotent and quick
# when everything is already there. Run as root.
set -euo pipefail

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi

if ! docker compose version >/dev/null 2>&1; then
    # bookworm ships only Compose v1; trixie's docker-compose package is the v2 CLI plugin.
    work=$(mktemp -d)
    mkdir -p "$work/lists/partial" "$work/archives/partial"
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    echo "deb $uri trixie main" > "$work/trixie.list"
    apt_options=(-o "Dir::Etc::SourceList=$work/trixie.list" -o "Dir::Etc::SourceParts=-"
                 -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::Archives=$work/archives")
    apt-get "${apt_options[@]}" update -qq
    (cd "$work" && apt-get "${apt_options[@]}" download docker-compose >/dev/null)
    dpkg -x "$work"/docker-compose_*.deb "$work/pkg"
    mkdir -p /usr/local/lib/docker/cli-plugins
    cp "$work/pkg/usr/libexec/docker/cli-plugins/docker-compose" /usr/local/lib/docker/cli-plugins/
    rm -rf "$work"
fi

if ! docker info >/dev/null 2>&1; then
    nohup dockerd >/var/log/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'engine {{.ServerVersion}}' && docker compose version
