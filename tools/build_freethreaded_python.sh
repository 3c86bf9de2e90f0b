#!/usr/bin/env bash
# Build a free-threaded CPython 3.13 (PEP 703, `python3.13t`) into a git-ignored folder of the
# repository, for `make test-freethreaded` and the thread-scaling figures.
#
# The source is Debian's copy of the python.org release tarball (python.org itself may be out of
# reach; the archive is a plain mirror of the same file). No PGO/LTO and no test suite: the
# interpreter is for tests and figures of the extension, so the quick build is enough.
#
# Usage: tools/build_freethreaded_python.sh [PREFIX]    (default: .python-ft)
# Environment: PY_FT_TARBALL (cached tarball, default /tmp/python3.13_3.13.5.orig.tar.xz),
#              JOBS (make -j, default: the number of cores).
set -euo pipefail

VERSION=3.13.5
URL="http://deb.debian.org/debian/pool/main/p/python3.13/python3.13_${VERSION}.orig.tar.xz"
MD5=dbaa8833aa736eddbb18a6a6ae0c10fa

root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="$(realpath -m "${1:-$root/.python-ft}")"
tarball="${PY_FT_TARBALL:-/tmp/python3.13_${VERSION}.orig.tar.xz}"
jobs="${JOBS:-$(nproc)}"

if [ -x "$prefix/bin/python3.13t" ] && "$prefix/bin/python3.13t" -c \
	'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))'; then
	echo "free-threaded CPython already at $prefix/bin/python3.13t"
	exit 0
fi

if [ ! -f "$tarball" ] || ! echo "$MD5  $tarball" | md5sum -c --status; then
	echo "downloading $URL"
	curl -fsSL -o "$tarball.part" "$URL"
	mv "$tarball.part" "$tarball"
fi
# A tarball that does not match is never built.
echo "$MD5  $tarball" | md5sum -c --status || { echo "checksum mismatch: $tarball" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xJf "$tarball" -C "$work"
cd "$work/Python-$VERSION"
./configure -q --disable-gil --prefix="$prefix" --with-ensurepip=install --disable-test-modules
make -s -j"$jobs"
make -s install >/dev/null
"$prefix/bin/python3.13t" -c 'import sys, sysconfig; assert sysconfig.get_config_var("Py_GIL_DISABLED"); print(sys.version)'
