#!/usr/bin/env bash
# Installs nginx from Debian's packages when it is missing: tests/e2e/test_e2e_replicas.py runs
# deploy/nginx/sluice.conf in front of two live replicas. Needs root or sudo, like
# scripts/check_compose.sh. nginx is run by the test itself, never as a system service.
set -euo pipefail
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
bash "$(dirname "$0")/apt_install.sh" nginx
# A package install may start nginx as a service on port 80: the tests need none.
if command -v service >/dev/null; then
  $([ "$(id -u)" = 0 ] || echo sudo) service nginx stop >/dev/null 2>&1 || true
fi
echo "nginx: $(/usr/sbin/nginx -v 2>&1)"
