#!/usr/bin/env bash
# The launchers a cluster uses, for real, on this one machine: a 2-rank teacher run and a 2-rank `serve --smoke`
# through DeepSpeed's own runner with `--launcher openmpi` (mpirun, a localhost hostfile of 2 slots) and with its
# default pdsh runner over two "nodes" that are both this machine (node-a and node-b, one slot each, reached by ssh
# with a key made for the run). Each must form one group of 2 ranks, expert parallel 2, and give what the local
# launcher gives (`--nproc 2`): the same held-out loss (fp32, same seed) and the same greedy completion.
#
#     bash scripts/launchers_check.sh [OUT]      # default OUT: /tmp/launchers-check; about 5 minutes on 2 cores
#
# Needs root (or the tools already installed). Installs, if missing, Debian's openmpi-bin, libopenmpi-dev, pdsh and
# openssh-server, and mpi4py into .venv (DeepSpeed's MPI discovery uses it); those stay installed. Everything else
# (keys, an sshd on a free loopback port with its own configuration, hostfiles, runs, packages) lives in a temporary
# folder and is removed at exit; the sshd is stopped; nothing under ~/.ssh or /etc is changed. Results: OUT/summary.json
# and each command's output in OUT/*.log. Exit status 0 when every launcher agreed with the local one.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-/tmp/launchers-check}")
PY=$PWD/.venv/bin/python
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/summary.json

need=()
command -v mpirun >/dev/null || need+=(openmpi-bin libopenmpi-dev)
command -v pdsh >/dev/null || need+=(pdsh)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh-keygen >/dev/null || need+=(openssh-client)
if [ ${#need[@]} -gt 0 ]; then
  echo "[launchers] installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$PY" -c "import mpi4py" 2>/dev/null || "$PY" -m pip install -q mpi4py

T=$(mktemp -d /tmp/launchers-check.XXXXXX)
SSHD_PID=
MADE_RUN_SSHD=
cleanup() {
  if [ -n "$SSHD_PID" ]; then kill "$SSHD_PID" 2>/dev/null || true; wait "$SSHD_PID" 2>/dev/null || true; fi
  if [ -n "$MADE_RUN_SSHD" ]; then rmdir /run/sshd 2>/dev/null || true; fi
  rm -rf "$T"
}
trap cleanup EXIT

# -- ssh to two names for this machine, through an sshd of our own --------------------------------------------------
ssh-keygen -q -t ed25519 -N '' -f "$T/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$T/id"
cp "$T/id.pub" "$T/authorized_keys"
SSH_PORT=$("$PY" -c 'from pipeline.dist import free_port; print(free_port())')
cat >"$T/sshd_config" <<EOF
Port $SSH_PORT
ListenAddress 127.0.0.1
HostKey $T/host_key
AuthorizedKeysFile $T/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile $T/sshd.pid
EOF
if [ ! -d /run/sshd ]; then mkdir -p /run/sshd && MADE_RUN_SSHD=1; fi
/usr/sbin/sshd -D -e -f "$T/sshd_config" 2>"$OUT/sshd.log" &
SSHD_PID=$!
cat >"$T/ssh_config" <<EOF
Host node-a node-b
  HostName 127.0.0.1
  Port $SSH_PORT
  User $(id -un)
  IdentityFile $T/id
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
EOF
export PDSH_SSH_ARGS_APPEND="-F $T/ssh_config"   # pdsh's ssh module appends these to every ssh it runs
for _ in $(seq 50); do ssh -F "$T/ssh_config" -o BatchMode=yes node-b true 2>/dev/null && break; sleep 0.2; done
ssh -F "$T/ssh_config" -o BatchMode=yes node-b true

printf 'localhost slots=2\n' >"$T/hostfile-mpi"
printf 'node-a slots=1\nnode-b slots=1\n' >"$T/hostfile-pdsh"
MPI_ARGS="--oversubscribe --mca btl_tcp_if_include lo --mca btl_vader_single_copy_mechanism none"
[ "$(id -u)" = 0 ] && MPI_ARGS="--allow-run-as-root $MPI_ARGS"

# the tiny recipe cut small: fp32, seed 0, 20 steps, a checkpoint and a held-out loss on 4 batches
SETS=(--set model.layers=4 --set model.hidden=64 --set model.heads=4 --set "model.experts=[2,4]"
      --set data.seq_len=64 --set teacher.train.micro_batch_size=4 --set teacher.train.global_batch_size=8
      --set teacher.train.warmup_steps=2 --set teacher.train.steps=20 --set teacher.train.eval_every=20
      --set teacher.train.checkpoint_every=10 --set teacher.train.eval_batches=4 --set teacher.train.log_every=5
      --set student.layers=3)
runner() {  # DeepSpeed's runner, as `deepspeed ARGS` runs it
  "$PY" -m deepspeed.launcher.runner "$@"
}
free_port() { "$PY" -c 'from pipeline.dist import free_port; print(free_port())'; }
launch() {  # NAME MODULE ARGS...: `python -m MODULE ARGS` on 2 ranks through launcher NAME (local, openmpi, pdsh)
  local name=$1 module=$2; shift 2
  case $name in
    local) if [ "$module" = cli ]; then "$PY" -m cli "$@" --nproc 2  # relaunches itself
           else runner --num_gpus 2 --master_port "$(free_port)" --no_local_rank --module "$module" "$@"; fi ;;
    openmpi) runner --hostfile "$T/hostfile-mpi" --launcher openmpi --force_multi --no_ssh_check \
                    --master_addr 127.0.0.1 --launcher_args "$MPI_ARGS" --module "$module" "$@" ;;
    pdsh) runner --hostfile "$T/hostfile-pdsh" --launcher pdsh --no_ssh_check --master_addr 127.0.0.1 \
                 --master_port "$(free_port)" --no_local_rank --module "$module" "$@" ;;
  esac
}

"$PY" -m cli prepare recipes/tiny.yaml "${SETS[@]}" >"$OUT/prepare.log" 2>&1 || { tail -5 "$OUT/prepare.log" >&2; exit 1; }
status=0
for name in local openmpi pdsh; do
  echo "[launchers] $name: python -m pipeline.dist"
  launch "$name" pipeline.dist >"$OUT/$name-group.log" 2>&1 </dev/null || { echo "  failed ($OUT/$name-group.log)"; status=1; }
  echo "[launchers] $name: teacher, 2 ranks"
  t0=$SECONDS
  if launch "$name" cli teacher recipes/tiny.yaml --run-dir "$T/$name" "${SETS[@]}" >"$OUT/$name-teacher.log" 2>&1 </dev/null
  then echo "  $((SECONDS - t0))s"; else echo "  failed ($OUT/$name-teacher.log)"; status=1; fi
  if [ "$name" = local ] && [ -f "$T/local/teacher/DONE.json" ]; then
    "$PY" -m cli export "$T/local" --stage teacher --out "$T/package" >"$OUT/export.log" 2>&1
  fi
  echo "[launchers] $name: serve --smoke, 2 ranks"
  t0=$SECONDS
  if launch "$name" cli serve "$T/package" --port 0 --smoke "And God said" >"$OUT/$name-serve.log" 2>&1 </dev/null
  then echo "  $((SECONDS - t0))s"; else echo "  failed ($OUT/$name-serve.log)"; status=1; fi
done

T="$T" OUT="$OUT" "$PY" - <<'EOF' || status=1
import json, os, re, sys
from pathlib import Path

T, OUT = Path(os.environ["T"]), Path(os.environ["OUT"])
summary, ok = {}, True
for name in ("local", "openmpi", "pdsh"):
    r = {}
    group = [json.loads(g) for g in re.findall(r'\{"launcher"[^{}]*\}', (OUT / f"{name}-group.log").read_text())]
    r["group"] = sorted(group, key=lambda g: g["rank"])
    done = T / name / "teacher" / "DONE.json"
    if done.is_file():
        d = json.loads(done.read_text())
        r["teacher"] = {k: d[k] for k in ("world_size", "expert_parallel", "val_loss", "steps")}
    serve = re.sub(r"(?m)^node-[ab]: ", "", (OUT / f"{name}-serve.log").read_text())  # pdsh's host prefix
    r["serve_layout"] = next((l.strip() for l in serve.splitlines() if " on http://" in l), None)
    r["serve_completion"] = next((l.strip() for l in serve.splitlines() if "POST /v1/completions" in l), None)
    summary[name] = r
local = summary["local"]
for name in ("openmpi", "pdsh"):
    r = summary[name]
    checks = {
        "one group of 2": len(r["group"]) == 2 and all(g["world"] == 2 and g["all_reduce"] == 2.0 for g in r["group"]),
        "teacher world 2, expert parallel 2": (r.get("teacher") or {}).get("world_size") == 2
            and set((r.get("teacher") or {}).get("expert_parallel") or [0]) == {2},
        "held-out loss equals the local launcher's": (r.get("teacher") or {}).get("val_loss") is not None
            and r["teacher"]["val_loss"] == (local.get("teacher") or {}).get("val_loss"),
        "serve on 2 ranks": bool(r["serve_layout"]) and "2 rank" in r["serve_layout"],
        "same greedy completion as local": r["serve_completion"] is not None
            and r["serve_completion"] == local["serve_completion"],
    }
    r["checks"] = checks
    ok &= all(checks.values())
summary["ok"] = ok
(OUT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
for name, r in summary.items():
    if name == "ok":
        continue
    print(f"{name}:")
    print("  group: " + "; ".join(f"rank {g['rank']}/{g['world']} ({g['launcher']}, local {g['local_rank']}/"
                                  f"{g['local_world']}, {g['backend']}, master {g['master']})" for g in r["group"]))
    print(f"  teacher: {r.get('teacher')}")
    print(f"  serve: {r['serve_layout']}")
    print(f"  {r['serve_completion']}")
    for k, v in (r.get("checks") or {}).items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
print("PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
exit $status
