#!/usr/bin/env bash
# Installs nginx from Debian's packages when it is missing: tests/e2e/test_e2e_replicas.py runs
# deploy/nginx/sluice.conf in front of two live replicas. Needs root or sudo, like
# scripts/check_compose.sh. nginx is run by the test itself, never as a system service.
set -euo pipefail
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || {
    echo "ensure_nginx: nginx is missing; install it as root (no sudo here)" >&2
    exit 1
  }
  sudo="sudo"
fi
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
# A package install may start nginx as a service on port 80: the tests need none.
if command -v service >/dev/null; then
  $sudo service nginx stop >/dev/null 2>&1 || true
fi
echo "nginx: $(/usr/sbin/nginx -v 2>&1)"
