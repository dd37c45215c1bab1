#!/usr/bin/env bash
# Builds the local base image gradq-base:bookworm-slim from Debian's own packages
# (no registry is reachable here), a Prometheus image on it, and a wheelhouse for offline pip installs in
# containers (their pip cannot verify TLS here). Idempotent. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

image=gradq-base:bookworm-slim
if ! docker image inspect "$image" >/dev/null 2>&1; then
    echo "building $image with debootstrap (about a minute)"
    root=$(mktemp -d)
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$root" "$uri" >/dev/null
    # What no container reads: the downloaded packages, apt's lists, docs (about 150 MB).
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
    tar -C "$root" -c . | docker import - "$image" >/dev/null
    rm -rf "$root"
fi
echo "base image: $image ($(docker image inspect --format '{{.Size}}' "$image" | awk '{printf "%d MB", $1 / 1e6}'))"

# Prometheus for compose.yaml's `monitoring` profile, from Debian's package (the
# default build pulls the public prom/prometheus image instead).
prometheus=gradq-prometheus:bookworm
if ! docker image inspect "$prometheus" >/dev/null 2>&1; then
    echo "building $prometheus from Debian's prometheus package"
    work=$(mktemp -d)
    (cd "$work" && apt-get download prometheus >/dev/null 2>&1)
    dpkg -x "$work"/prometheus_*.deb "$work/pkg"
    cp "$work/pkg/usr/bin/prometheus" "$work/prometheus"
    printf 'FROM %s\nCOPY prometheus /bin/prometheus\nENTRYPOINT ["/bin/prometheus"]\n' "$image" > "$work/Dockerfile"
    docker build --quiet --tag "$prometheus" "$work" >/dev/null
    rm -rf "$work"
fi
echo "prometheus image: $prometheus"

# Every wheel the images install, pinned like the tests; the containers install
# from here with --no-index. Python 3.11 on both sides, so the same wheels fit.
echo "filling docker/wheelhouse (pip wheel; quick once its wheels are there)"
python="${PYTHON:-python3}"
"$python" -m pip wheel --quiet --disable-pip-version-check -w docker/wheelhouse \
    -c tests/constraints.txt '.[demo]' 'setuptools>=69'
rm -f docker/wheelhouse/gradq-*.whl  # images build gradq from the source tree
echo "wheelhouse: $(ls docker/wheelhouse | wc -l) wheels in docker/wheelhouse"
