#!/usr/bin/env bash
# Start a kvps job over ssh from a host file: the scheduler on the first host, servers and
# workers spread round-robin over all hosts. Every output line comes back prefixed with the
# process's role and rank; the first process to fail stops the others.
#
# usage: launch/ssh_launch.sh -H HOSTFILE -n WORKERS -s SERVERS [-p PORT] [-i SCHEDULER_ADDR]
#                             [-d REMOTE_DIR] [-e NAME=VALUE]... -- command ...
#
#   HOSTFILE        one host per line (as ssh knows it); blank lines and # comments ignored
#   -p PORT         scheduler port (default 9091; must be free on the first host); 0: the
#                   scheduler binds one the OS picks, and the others are told it
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

usage() { sed -n '6,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

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
# -p 0: the scheduler writes the port it bound to this file in DIR on the first host (and
# files beside it as the job goes on), read back over ssh and removed at the end
port_file=
if [[ $port == 0 ]]; then port_file=.kvps-ssh-launch-$$-$RANDOM.port; fi
cleanup() {
  rm -rf "$state"
  [[ -z $port_file ]] || "${ssh_cmd[@]}" "${hosts[0]}" "cd $(printf '%q' "$dir") && rm -f \
    $port_file $port_file.formed $port_file.blame" < /dev/null > /dev/null 2>&1 || true
}
trap cleanup EXIT

common=(DMLC_PS_ROOT_URI="$sched_addr" DMLC_NUM_WORKER="$workers" DMLC_NUM_SERVER="$servers"
        PYTHONUNBUFFERED=1 ${extra[@]+"${extra[@]}"})

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

# scheduler_port PID: the port the scheduler (started as job PID) wrote to $port_file; fails
# once it has exited, or after KVPS_CONNECT_TIMEOUT (default 120) seconds
scheduler_port() {
  local limit=${KVPS_CONNECT_TIMEOUT:-120} got
  local deadline=$(( SECONDS + ${limit%.*} + 1 ))
  while (( SECONDS < deadline )) && kill -0 "$1" 2> /dev/null; do
    got=$("${ssh_cmd[@]}" "${hosts[0]}" "cd $(printf '%q' "$dir") && cat $port_file" \
          < /dev/null 2> /dev/null) || true
    [[ $got =~ ^[0-9]+$ ]] && { echo "$got"; return 0; }
    sleep 0.2
  done
  return 1
}

start scheduler "${hosts[0]}" "${common[@]}" DMLC_PS_ROOT_PORT="$port" \
  ${port_file:+KVPS_PORT_FILE="$port_file"} DMLC_ROLE=scheduler "$python" -m kvps.node
if [[ -n $port_file ]]; then
  sched=$!
  if ! port=$(scheduler_port "$sched"); then
    if kill -0 "$sched" 2> /dev/null; then
      echo "ssh_launch: the scheduler on ${hosts[0]} wrote no port to $dir/$port_file" >&2
      stop_all
      exit 1
    fi
    rc=0
    wait "$sched" || rc=$?   # it failed first, and said so
    exit $(( rc ? rc : 1 ))
  fi
else
  sleep 1  # the scheduler must listen before the others' connect timeout starts to matter
fi
common+=(DMLC_PS_ROOT_PORT="$port")
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
