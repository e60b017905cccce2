#!/bin/sh
# Checks that the Debian packages of tools/debian-packages are present, the
# way the build will look for them (pkg-config modules, commands, files).
# When some are missing: as root it installs exactly those, once and without
# questions (apt-get update, then apt-get install); otherwise it prints the
# apt-get line to run and exits 1, before anything is compiled.
# KVT_DEPS_INSTALL=0 never installs (as if not root).
#
# Usage: tools/deps.sh [GOAL]. Without GOAL it checks the packages every
# build needs (the lines of the list with no third column); with a make goal
# (`tools/deps.sh fuzz`) also those whose third column names that goal (a
# comma-separated list of goals).
set -u
list="$(dirname "$0")/debian-packages"
goal=${1:-}

missing_pkgs() {
    grep -v '^[[:space:]]*#' "$list" | while read -r pkg check goals _; do
        [ -n "$pkg" ] || continue
        case ${goals:+,$goals,} in
        "" | *",$goal,"*) ;;
        *) continue ;;
        esac
        kind=${check%%:*} name=${check#*:}
        case $kind in
        pc)   command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "$name" ;;
        cmd)  command -v "$name" >/dev/null 2>&1 ;;
        file) [ -e "$name" ] ;;
        *)    false ;;
        esac || printf '%s ' "$pkg"
    done
}

missing=$(missing_pkgs)
[ -z "$missing" ] && exit 0
missing=${missing% }

if [ "$(id -u)" = 0 ] && [ "${KVT_DEPS_INSTALL:-1}" != 0 ]; then
    echo "kvtier: installing the missing Debian packages: $missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086
    if apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing >/dev/null; then
        still=$(missing_pkgs)
        [ -z "$still" ] && exit 0
        echo "kvtier: installed, but the build still cannot find: ${still% }" >&2
        echo "kvtier: (is PKG_CONFIG_PATH or PKG_CONFIG_LIBDIR set?)" >&2
        exit 1
    fi
    echo "kvtier: apt-get could not install: $missing" >&2
    exit 1
fi

echo "kvtier: missing Debian packages: $missing" >&2
echo "kvtier: install them as root with:" >&2
echo "    apt-get install -y $missing" >&2
exit 1
