#!/usr/bin/env bash
# Build a free-threaded CPython 3.14 (PEP 703/779, `python3.14t`) into a git-ignored folder of
# the repository, for `make test-freethreaded` and the thread-scaling figures. 3.14, not 3.13:
# PyO3 0.30 refuses to build for a free-threaded interpreter older than 3.14.
#
# The source is Ubuntu's copy of the python.org release tarball (its `.orig.tar.xz`; python.org
# itself may be out of reach), checked against the SHA-256 of Ubuntu's source index. No PGO/LTO
# and no test suite: the interpreter is for tests and figures of the extension, so the quick
# build is enough (about 5 minutes on two cores).
#
# Usage: tools/build_freethreaded_python.sh [PREFIX]    (default: .python-ft)
# Environment: PY_FT_TARBALL (cached tarball, default /tmp/python3.14_3.14.4.orig.tar.xz),
#              JOBS (make -j, default: the number of cores).
set -euo pipefail

VERSION=3.14.4
URL="http://archive.ubuntu.com/ubuntu/pool/main/p/python3.14/python3.14_${VERSION}.orig.tar.xz"
SHA256=d923c51303e38e249136fc1bdf3568d56ecb03214efdef48516176d3d7faaef8

root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="$(realpath -m "${1:-$root/.python-ft}")"
tarball="${PY_FT_TARBALL:-/tmp/python3.14_${VERSION}.orig.tar.xz}"
jobs="${JOBS:-$(nproc)}"

if [ -x "$prefix/bin/python3.14t" ] && "$prefix/bin/python3.14t" -c \
	'import sys, sysconfig; sys.exit(not sysconfig.get_config_var("Py_GIL_DISABLED"))'; then
	echo "free-threaded CPython already at $prefix/bin/python3.14t"
	exit 0
fi

if [ ! -f "$tarball" ] || ! echo "$SHA256  $tarball" | sha256sum -c --status; then
	echo "downloading $URL"
	curl -fsSL -o "$tarball.part" "$URL"
	mv "$tarball.part" "$tarball"
fi
# A tarball that does not match is never built.
echo "$SHA256  $tarball" | sha256sum -c --status || { echo "checksum mismatch: $tarball" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tar -xJf "$tarball" -C "$work"
cd "$work/Python-$VERSION"
./configure -q --disable-gil --prefix="$prefix" --with-ensurepip=install --disable-test-modules
make -s -j"$jobs"
make -s install >/dev/null
"$prefix/bin/python3.14t" -c 'import sys, sysconfig; assert sysconfig.get_config_var("Py_GIL_DISABLED"); print(sys.version)'
