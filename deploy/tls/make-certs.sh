#!/usr/bin/env bash
# Makes the certificates the deployment files expect: a private CA, the coordinator's server certificate (for the
# names workers connect to) and one client certificate that workers present (mutual TLS).
#
#   deploy/tls/make-certs.sh [--key-owner UID] OUT_DIR [SERVER_NAME ...]   # default names: coordinator, localhost,
#                                                                           # 127.0.0.1
#
# OUT_DIR gets ca.pem (give it to both sides), ca.key (keep offline), server.pem + server.key (the coordinator),
# worker.pem + worker.key (the workers). Valid one year; run again to renew. Needs the openssl command.
# The private keys are readable by their owner only: --key-owner gives server.key and worker.key to UID (as root),
# for containers that bind-mount OUT_DIR and run as that user (Docker Compose: the images' user namm, uid 10001;
# without it they cannot open their keys and restart over and over).
set -euo pipefail
usage="usage: make-certs.sh [--key-owner UID] OUT_DIR [SERVER_NAME ...]"
owner=""
if [ "${1:-}" = --key-owner ]; then
  owner=${2:?$usage}
  [[ $owner =~ ^[0-9]+$ ]] || { echo "make-certs.sh: --key-owner takes a numeric uid, not '$owner'" >&2; exit 2; }
  shift 2
fi
out=${1:?$usage}
shift
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(coordinator localhost 127.0.0.1)
mkdir -p "$out"
umask 077
san="subjectAltName="
for n in "${names[@]}"; do
  if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
printf '%s\n' "${san%,}" > "$out/server.ext"
printf 'extendedKeyUsage=clientAuth\n' > "$out/worker.ext"
openssl req -x509 -newkey rsa:3072 -nodes -days 365 -subj /CN=namm-ca -keyout "$out/ca.key" -out "$out/ca.pem" 2>/dev/null
for who in server worker; do
  cn=$([ $who = server ] && echo "${names[0]}" || echo namm-worker)
  openssl req -newkey rsa:3072 -nodes -subj "/CN=$cn" -keyout "$out/$who.key" -out "$out/$who.csr" 2>/dev/null
  openssl x509 -req -in "$out/$who.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" -CAcreateserial -days 365 \
    -extfile "$out/$who.ext" -out "$out/$who.pem" 2>/dev/null
  rm -f "$out/$who.csr" "$out/$who.ext"
done
rm -f "$out/ca.srl"
chmod 0644 "$out/ca.pem" "$out/server.pem" "$out/worker.pem"
[ -z "$owner" ] || chown "$owner" "$out/server.key" "$out/worker.key"
echo "wrote $out: ca.pem, server.pem + server.key (${names[*]}), worker.pem + worker.key${owner:+ (keys owned by uid $owner)}"
