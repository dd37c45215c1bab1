#!/usr/bin/env bash
# Makes a throwaway CA, an aggregator certificate (names: aggregator,
# localhost) and a bearer token in docker/certs/ for
# compose.tls.yaml. Idempotent: keeps what is there. Not for production keys.
set -euo pipefail
out="$(dirname "$0")/certs"
mkdir -p "$out"
cd "$out"
if [ ! -s ca.pem ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
        -subj "/CN=gradq compose CA" -keyout ca.key -out ca.pem 2>/dev/null
fi
if [ ! -s server.pem ]; then
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=aggregator" \
        -keyout server.key -out server.csr 2>/dev/null
    printf 'subjectAltName=DNS:aggregator,DNS:localhost,IP:127.0.0.1\n' > server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
        -extfile server.ext -out server.pem 2>/dev/null
    rm -f server.csr server.ext
fi
[ -s token ] || openssl rand -hex 24 > token
cp token tokens  # the aggregator's token file: one unbound token, shared by the workers
chmod 644 ./*     # readable in the containers whatever user they run as (throwaway keys)
echo "certificates and token in $out"
