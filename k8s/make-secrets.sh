#!/usr/bin/env bash
# Create the three Secrets the manifests read, in namespace NAMESPACE (default: the current one):
#   etcd-tls                    etcd's server certificate (names etcd, etcd.NS.svc...) and, from a CA of their own,
#                               its peer certificate (*.etcd-peers...) and that CA
#   elastic-runner-etcd-client  the training pods' client certificate (etcd accepts no client without one)
#   elastic-runner-rdzv-key     the job's secret: every rendezvous state, store value and snapshot is signed with it
#                               (with --job NAME: elastic-runner-rdzv-key-NAME, a key of that Job's own)
# Two CAs made here (keys left in $OUT, default ./k8s-secrets, mode 0700: keep them or delete them): the client CA
# signs the server and client certificates, the peer CA only the peer certificate, so a peer's certificate does not
# open etcd's client port. etcd's server certificate must carry client auth too (etcd's HTTP gateway, which the
# agents use, dials etcd with it): its key stays in the etcd pods; a writer without the job key can only delete
# (docs/trust.md). Idempotent: existing Secrets are replaced, the CAs and the job key are kept. cert-manager
# users create the same Secrets with Certificates instead (k8s/README.md).
#
#   k8s/make-secrets.sh [NAMESPACE]               files in $OUT, then the Secrets (kubectl apply)
#   k8s/make-secrets.sh --files-only [NAMESPACE]  only the files (an etcd outside Kubernetes, a review)
#   k8s/make-secrets.sh --job NAME [NAMESPACE]    also a job key of its own for Job NAME (rdzv-NAME.key): one key per
#                                                 Job, so that no Job takes another's snapshots or store values even
#                                                 where their volumes or buckets are mixed up (docs/trust.md)
set -euo pipefail
FILES_ONLY=false
JOB=""
usage() { echo "usage: $0 [--files-only] [--job NAME] [NAMESPACE]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --files-only) FILES_ONLY=true; shift;;
    --job) [ $# -ge 2 ] || usage; JOB=$2; shift 2;;
    -*) usage;;
    *) break;;
  esac
done
if [ -n "$JOB" ] && ! [[ "$JOB" =~ ^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$ ]]; then
  echo "make-secrets.sh: --job '$JOB' is not a Kubernetes name: use lower-case letters, digits and '-' (at most 40)" >&2
  exit 2
fi
KEY=rdzv${JOB:+-$JOB}.key
KEY_SECRET=elastic-runner-rdzv-key${JOB:+-$JOB}
NS=${1:-$(kubectl config view --minify -o jsonpath='{..namespace}' 2>/dev/null || true)}
NS=${NS:-default}
OUT=${OUT:-./k8s-secrets}
DAYS=${DAYS:-825}
umask 077
mkdir -p "$OUT"
cd "$OUT"

for ca in ca:elastic-runner-etcd-ca peer-ca:elastic-runner-etcd-peer-ca; do
  if [ ! -f "${ca%%:*}.key" ]; then
    openssl req -x509 -newkey rsa:3072 -nodes -days "$DAYS" -subj "/CN=${ca#*:}" \
      -keyout "${ca%%:*}.key" -out "${ca%%:*}.crt"
  fi
done

sign() {  # sign NAME SUBJECT EXTFILE CA
  openssl req -newkey rsa:3072 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA "$4.crt" -CAkey "$4.key" -CAcreateserial -days "$DAYS" -extfile "$3" -out "$1.crt"
  rm -f "$1.csr"
}

cat > server.ext <<EXT
subjectAltName=DNS:etcd,DNS:etcd.$NS,DNS:etcd.$NS.svc,DNS:etcd.$NS.svc.cluster.local,DNS:*.etcd-peers,DNS:*.etcd-peers.$NS.svc,DNS:*.etcd-peers.$NS.svc.cluster.local,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth
EXT
cat > peer.ext <<EXT
subjectAltName=DNS:*.etcd-peers,DNS:*.etcd-peers.$NS.svc,DNS:*.etcd-peers.$NS.svc.cluster.local,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth
EXT
cat > client.ext <<EXT
extendedKeyUsage=clientAuth
EXT
sign server etcd server.ext ca
sign peer etcd-peer peer.ext peer-ca
sign client elastic-runner client.ext ca
[ -f "$KEY" ] || openssl rand -hex 32 > "$KEY"

if $FILES_ONLY; then
  echo "Certificates and the job key ($KEY) are in $OUT (namespace $NS in the server's names)."
  exit 0
fi
apply() { kubectl -n "$NS" create secret generic "$@" --dry-run=client -o yaml | kubectl -n "$NS" apply -f -; }
apply etcd-tls --from-file=ca.crt=ca.crt --from-file=tls.crt=server.crt --from-file=tls.key=server.key \
  --from-file=peer-ca.crt=peer-ca.crt --from-file=peer.crt=peer.crt --from-file=peer.key=peer.key
apply elastic-runner-etcd-client --from-file=ca.crt=ca.crt --from-file=tls.crt=client.crt --from-file=tls.key=client.key
apply "$KEY_SECRET" --from-file=key="$KEY"
echo "Secrets etcd-tls, elastic-runner-etcd-client, $KEY_SECRET are in namespace $NS (CA in $OUT)."
