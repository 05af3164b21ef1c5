#!/bin/sh
# Install the pagedkv systemd units. Run as root, after the code is in place:
#
#   sudo git clone <repo> /opt/pagedkv     # the units run /opt/pagedkv/.venv/bin/pagedkv
#   cd /opt/pagedkv && sudo make setup EXTRAS=worker,fast VENV_FLAGS=--system-site-packages
#   sudo deploy/systemd/install.sh
#   sudoedit /etc/pagedkv/pagedkv.env      # model path, KV budget, ports
#   sudo systemctl enable --now pagedkv-control   # pulls in pagedkv-worker
#
# Idempotent: re-running updates the units and drop-ins but never overwrites an existing
# /etc/pagedkv/pagedkv.env (the new defaults go to pagedkv.env.dist next to it).
#
# Environment (for packaging and tests):
#   DESTDIR          install into this root instead of / (no systemctl calls then)
#   JETSON=1|0       install the Jetson GPU device drop-in (default: 1 if /etc/nv_tegra_release exists)
#   SYSTEMD_VERSION  systemd's version number (default: from `systemctl --version`); the
#                    growing-restart-delay drop-in needs 254 or later
set -eu

SRC=$(cd "$(dirname "$0")" && pwd)
DESTDIR=${DESTDIR:-}
UNIT_DIR="$DESTDIR/etc/systemd/system"
CONF_DIR="$DESTDIR/etc/pagedkv"
SYSUSERS_DIR="$DESTDIR/etc/sysusers.d"
PREFIX=/opt/pagedkv

if [ -z "${JETSON:-}" ]; then
    if [ -e /etc/nv_tegra_release ]; then JETSON=1; else JETSON=0; fi
fi
if [ -z "${SYSTEMD_VERSION:-}" ]; then
    # First line: "systemd 252 (252.38-1~deb12u1)".
    SYSTEMD_VERSION=$(systemctl --version 2>/dev/null | awk 'NR == 1 { print $2 }' | cut -d. -f1 | cut -d~ -f1)
fi
case "$SYSTEMD_VERSION" in
    '' | *[!0-9]*) SYSTEMD_VERSION=0 ;;
esac

say() { printf 'pagedkv install: %s\n' "$*"; }

# The account first: units referring to a missing User= fail at start.
install -D -m 0644 "$SRC/pagedkv.sysusers" "$SYSUSERS_DIR/pagedkv.conf"
if [ -n "$DESTDIR" ]; then
    systemd-sysusers --root="$DESTDIR" "$SYSUSERS_DIR/pagedkv.conf"
else
    systemd-sysusers "$SYSUSERS_DIR/pagedkv.conf"
fi

install -D -m 0644 "$SRC/pagedkv-worker.service" "$UNIT_DIR/pagedkv-worker.service"
install -D -m 0644 "$SRC/pagedkv-control.service" "$UNIT_DIR/pagedkv-control.service"

# Settings: root-owned, world-readable (it holds no secrets; the API has no credentials).
if [ -e "$CONF_DIR/pagedkv.env" ]; then
    install -D -m 0644 "$SRC/pagedkv.env" "$CONF_DIR/pagedkv.env.dist"
    say "kept $CONF_DIR/pagedkv.env; the shipped defaults are in pagedkv.env.dist"
else
    install -D -m 0644 "$SRC/pagedkv.env" "$CONF_DIR/pagedkv.env"
fi

if [ "$JETSON" = 1 ]; then
    install -D -m 0644 "$SRC/dropins/jetson-devices.conf" \
        "$UNIT_DIR/pagedkv-worker.service.d/jetson-devices.conf"
    say "Jetson: allowed the integrated GPU's device nodes (jetson-devices.conf)"
else
    rm -f "$UNIT_DIR/pagedkv-worker.service.d/jetson-devices.conf"
fi

for unit in pagedkv-worker pagedkv-control; do
    if [ "$SYSTEMD_VERSION" -ge 254 ]; then
        install -D -m 0644 "$SRC/dropins/restart-backoff.conf" "$UNIT_DIR/$unit.service.d/restart-backoff.conf"
    else
        rm -f "$UNIT_DIR/$unit.service.d/restart-backoff.conf"
    fi
done
if [ "$SYSTEMD_VERSION" -lt 254 ]; then
    say "systemd $SYSTEMD_VERSION < 254: fixed restart delay (no RestartSteps=); start limit 10 per 10 min"
fi

if [ ! -x "$DESTDIR$PREFIX/.venv/bin/pagedkv" ]; then
    say "warning: $PREFIX/.venv/bin/pagedkv is missing; run 'make setup' in $PREFIX (see docs/DEPLOY_ORIN.md)"
fi

if [ -z "$DESTDIR" ]; then
    systemctl daemon-reload
    say "installed. Edit $CONF_DIR/pagedkv.env, then: systemctl enable --now pagedkv-control"
fi
