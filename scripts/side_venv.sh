#!/usr/bin/env bash
# A venv of its own for an extra whose pins clash with .venv (litert-torch, flwr): torch first, then moetool with the
# extra under constraints.txt, then an import check.
#   bash scripts/side_venv.sh VENV EXTRA PYTHON_CHECK
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$1" extra="$2" check="$3"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q torch==2.13.0
if ! "$venv/bin/python" -m pip install -q -c constraints.txt -e ".[$extra]" >"$venv/pip-install.log" 2>&1; then
  grep -v "is ignored: it is neither" "$venv/pip-install.log" >&2 || true
  echo "setup: $venv install failed (full log: $venv/pip-install.log)" >&2
  exit 1
fi
"$venv/bin/python" -c "$check"
