#!/usr/bin/env bash
# `scripts/apt_install.sh PACKAGE [COMMAND]`: installs Debian's PACKAGE when COMMAND (default:
# PACKAGE) is missing, as root or through sudo. For the system tools CI needs (docker-compose,
# nginx); prints whether it installed anything on stderr, nothing else.
set -euo pipefail
package=$1
command_name=${2:-$1}
if command -v "$command_name" >/dev/null || [ -x "/usr/sbin/$command_name" ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || {
    echo "apt_install: $command_name is missing; install $package as root (no sudo here)" >&2
    exit 1
  }
  sudo="sudo"
fi
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null
echo "apt_install: installed $package" >&2
