# Sourced by scripts/demo.sh and scripts/test.sh: make sure .venv holds torch 2.13.0 (CPU),
# megatron-core 0.16.1 and this project, then activate it. Re-installs only when pyproject.toml changes.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${RECOVER_VENV:-$_root/.venv}"
_stamp="$_venv/.recover-installed"
_want="$(sha1sum "$_root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
    echo "[env] installing into $_venv (torch 2.13.0 CPU, megatron-core 0.16.1, recover) ..." >&2
    python3 -m venv "$_venv"
    "$_venv/bin/pip" install --quiet --upgrade pip
    # torch first and pinned: an unpinned resolve would pull the multi-GB CUDA build.
    "$_venv/bin/pip" install --quiet torch==2.13.0
    "$_venv/bin/pip" install --quiet -e "$_root[test,plot]"
    echo "$_want" > "$_stamp"
fi
# etcd (Debian's etcd-server) for the tests of the coordinator's leadership; they skip without it
if ! command -v etcd > /dev/null && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "[env] installing etcd-server (apt) ..." >&2
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; }
    } > /dev/null 2>&1 || echo "[env] etcd-server not installed: its tests will be skipped" >&2
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
