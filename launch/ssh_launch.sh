#!/usr/bin/env bash
# Start a kvps job over ssh from a host file: the scheduler on the first host, servers and
# workers spread round-robin over all hosts. Every output line comes back prefixed with the
# process's role and rank; the first process to fail stops the others.
#
# usage: launch/ssh_launch.sh -H HOSTFILE -n WORKERS -s SERVERS [-p PORT] [-i SCHEDULER_ADDR]
#                             [-d REMOTE_DIR] [-e NAME=VALUE]... -- command ...
#
#   HOSTFILE        one host per line (as ssh knows it); blank lines and # comments ignored
#   -p PORT         scheduler port (default 9091; must be free on the first host)
#   -i ADDR         address everyone dials for the scheduler (default: the first host's name)
#   -d DIR          directory to run in on every host (default: this directory; shared fs)
#   -e NAME=VALUE   extra variable for every process (repeatable), e.g. -e DMLC_INTERFACE=eth0
#   PYTHON          interpreter for the scheduler and servers on the hosts (default python3)
#   SSH             ssh command (default: ssh -o BatchMode=yes)
#
# Needs bash >= 4.3 locally, passwordless ssh to every host, kvps installed on every host.
# ssh runs with -tt so that stopping the local ssh hangs up the remote process too.
set -euo pipefail
set -m  # each background job gets its own process group, so a kill reaches ssh and its reader

usage() { sed -n '6,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

hostfile= workers= servers= port=9091 sched_addr= dir=$PWD extra=()
while getopts 'H:n:s:p:i:d:e:h' opt; do
  case $opt in
    H) hostfile=$OPTARG ;; n) workers=$OPTARG ;; s) servers=$OPTARG ;; p) port=$OPTARG ;;
    i) sched_addr=$OPTARG ;; d) dir=$OPTARG ;; e) extra+=("$OPTARG") ;; *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ ${1:-} == -- ]] && shift
[[ -n $hostfile && -n $workers && -n $servers && $# -gt 0 ]] || usage
[[ $workers =~ ^[1-9][0-9]*$ && $servers =~ ^[1-9][0-9]*$ ]] || { echo "need -n >= 1 and -s >= 1" >&2; exit 2; }

mapfile -t hosts < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$hostfile" | grep -v '^$')
(( ${#hosts[@]} > 0 )) || { echo "no hosts in $hostfile" >&2; exit 2; }
sched_addr=${sched_addr:-${hosts[0]}}
python=${PYTHON:-python3}
read -r -a ssh_cmd <<< "${SSH:-ssh -o BatchMode=yes}"
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT

common=(DMLC_PS_ROOT_URI="$sched_addr" DMLC_PS_ROOT_PORT="$port"
        DMLC_NUM_WORKER="$workers" DMLC_NUM_SERVER="$servers" PYTHONUNBUFFERED=1 ${extra[@]+"${extra[@]}"})

# start NAME HOST VAR=VALUE... -- ARGV...: run ARGV on HOST, prefix its lines with [NAME]
declare -A names=()
start() {
  local name=$1 host=$2; shift 2
  local remote
  remote="cd $(printf '%q' "$dir") && exec env $(printf '%q ' "$@")"
  (
    set +e -o pipefail
    "${ssh_cmd[@]}" -tt "$host" "$remote" < /dev/null 2>&1 |
      while IFS= read -r line || [[ -n $line ]]; do printf '[%s] %s\n' "$name" "${line%$'\r'}"; done
    rc=$?
    if (( rc != 0 )) && [[ ! -e $state/stopping ]]; then
      echo "ssh_launch: $name on $host failed first: exit code $rc" >&2
    fi
    exit "$rc"
  ) &
  names[$!]=$name
}

stop_all() {
  touch "$state/stopping"
  exec 2> /dev/null  # bash's job-control "Terminated" notices are noise now; we said why
  local pid
  for pid in "${!names[@]}"; do kill -TERM -- "-$pid" 2> /dev/null || true; done
  for ((i = 0; i < ${GRACE:-5} * 10; i++)); do  # GRACE: seconds before SIGKILL
    [[ -z $(jobs -rp) ]] && break
    sleep 0.1
  done
  for pid in "${!names[@]}"; do kill -KILL -- "-$pid" 2> /dev/null || true; done
}
trap 'echo "ssh_launch: interrupted; stopping everything" >&2; stop_all; exit 130' INT
trap 'echo "ssh_launch: terminated; stopping everything" >&2; stop_all; exit 143' TERM

start scheduler "${hosts[0]}" "${common[@]}" DMLC_ROLE=scheduler "$python" -m kvps.node
sleep 1  # the scheduler must listen before the others' connect timeout starts to matter
for ((r = 0; r < servers; r++)); do
  start "server $r" "${hosts[$(( (r + 1) % ${#hosts[@]} ))]}" \
    "${common[@]}" DMLC_ROLE=server KVPS_RANK=$r "$python" -m kvps.node
done
for ((r = 0; r < workers; r++)); do
  start "worker $r" "${hosts[$(( (servers + 1 + r) % ${#hosts[@]} ))]}" \
    "${common[@]}" DMLC_ROLE=worker KVPS_RANK=$r "$@"
done

# The job ends when every process has exited; kvps stops the scheduler and servers once the
# workers finish. The first non-zero exit stops everything and becomes our exit code.
for ((left = ${#names[@]}; left > 0; left--)); do
  rc=0
  wait -n || rc=$?
  if (( rc != 0 )); then
    stop_all
    exit "$rc"
  fi
done
