#!/usr/bin/env bash
# Makes the files of the Secret tierserve-tls (deploy/README.md, TLS): a CA (ca.crt; ca.key stays
# with you, never in the cluster) and one certificate for the DNS name the router checks
# (TIERSERVE_TLS_SERVER_NAME, default tierserve-node) with its key (tls.crt, tls.key). The nodes
# serve it and the router presents it: it carries no extended key usage, so it is valid for both.
#   deploy/tls-certs.sh DIR [DNS_NAME] [DAYS]
set -euo pipefail
dir=${1:?usage: $0 DIR [DNS_NAME] [DAYS]}
name=${2:-tierserve-node}
days=${3:-365}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days "$days" -subj "/CN=tierserve-ca" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout tls.key -out tls.csr -subj "/CN=$name" 2>/dev/null
printf 'subjectAltName=DNS:%s\n' "$name" > san.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out tls.crt -days "$days" \
  -extfile san.ext 2>/dev/null
rm -f tls.csr san.ext ca.srl
chmod 600 ca.key tls.key
echo "made $dir/ca.crt, $dir/tls.crt, $dir/tls.key for DNS:$name (keep $dir/ca.key out of the cluster)"
