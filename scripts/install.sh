#!/usr/bin/env bash
# Install mlx-tandem into ./.venv; on Debian/Ubuntu Linux also install OpenBLAS,
# which mlx-tandem preloads so MLX's CPU backend multiplies ~30-50x faster.
# Usage: scripts/install.sh [--dev]     (--dev adds pytest, ruff, playwright and, on
# Debian/Ubuntu, Chromium for tests/test_chat_page.py; no browser is downloaded by playwright)
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"

if [[ "$(uname -s)" == "Linux" ]] && ! ldconfig -p 2>/dev/null | grep -q "libopenblas.so.0"; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "warning: no apt-get; install OpenBLAS yourself for fast CPU math" >&2
  fi
fi

if [[ -n "$extras" && "$(uname -s)" == "Linux" && ! -x /usr/bin/chromium ]]; then
  if command -v apt-get >/dev/null 2>&1; then
    sudo=""
    [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      chromium >/dev/null
  else
    echo "warning: no apt-get; install Chromium at /usr/bin/chromium for the chat page test" >&2
  fi
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".${extras}"
