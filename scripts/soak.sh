#!/usr/bin/env bash
# Crashes at random moments: SIGKILL a training run again and again, resume each time, and require
# the uninterrupted run hash at the end (scripts/soak.py says how). Usage: scripts/soak.sh [--trials N] [--steps S]
set -euo pipefail
exec python "$(dirname "$0")/soak.py" "$@"
