"""The shell that sparkrun runs around the server, in ColdSnap's layout.

sparkrun starts a container whose PID 1 sleeps, then starts the server beside it with `docker exec -d` and a
watchdog (another `docker exec`) that kills PID 1 when the server dies. CRIU dumps the process tree under a
container's PID 1, and an exec'd process is not in it: such a server cannot be captured. Under ColdSnap's executor
PID 1 starts the server itself once sparkrun hands it the serve script, and exits when the server does (the
watchdog, built in). Everything else is sparkrun's: the serve script, /tmp/sparkrun_serve.{sh,pid,log}, the
container's name, labels and options, readiness, logs and stop."""

from __future__ import annotations

import base64
import shlex

LOG = "/tmp/sparkrun_serve.log"
GO = "/tmp/sparkrun_serve.go"  # the serve script is in place: start it
OK = "/tmp/sparkrun_serve.ok"  # the serve step saw the server alive: PID 1 need not linger for its log

# PID 1's script. A server that dies before the serve step saw it alive leaves the container up a minute more, so
# that its log can be read (sparkrun installs its watchdog only after that check for the same reason).
SUPERVISOR = f"""# ColdSnap: PID 1 starts the server (CRIU captures the tree under PID 1) and exits with it.
while [ ! -e {GO} ]; do sleep 0.2; done
bash --noprofile --norc -c \
  'echo $$ > /tmp/sparkrun_serve.pid; exec bash --noprofile --norc /tmp/sparkrun_serve.sh > {LOG} 2>&1' &
wait $!
rc=$?
[ -e {OK} ] || sleep 60
exit $rc
"""


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def full_command(serve_command: str, env: dict[str, str] | None) -> str:
    """The serve script sparkrun writes: its environment exported, then the command."""
    exports = "".join(f"export {k}={shlex.quote(str(v))}; " for k, v in sorted((env or {}).items()))
    return exports + serve_command


def cold_serve(name: str, serve_command: str, env: dict[str, str] | None) -> str:
    """Hand the serve script to PID 1, then check the server is alive as sparkrun does."""
    q, cmd = shlex.quote(name), b64(full_command(serve_command, env))
    return f"""printf "Executing serve command in container '%s' (started by its PID 1, for ColdSnap)...\\n" {q}
echo "--- Command ---"
printf '%s' '{cmd}' | base64 -d --
echo -e "\\n---------------"
docker exec {q} bash -c "printf '%s' '{cmd}' | base64 -d -- > /tmp/sparkrun_serve.sh && touch {GO}" || exit 1
sleep 3
SERVE_PID=$(docker exec {q} cat /tmp/sparkrun_serve.pid 2>/dev/null)
if [ -z "$SERVE_PID" ] || ! docker exec {q} kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "============================================================" >&2
    echo "ERROR: Serve process exited immediately (PID $SERVE_PID)" >&2
    docker exec {q} cat {LOG} >&2 2>/dev/null || echo "(no log: the container is gone)" >&2
    exit 1
fi
docker exec {q} touch {OK}
echo "============================================================"
echo "Initial log output:"
docker exec {q} tail -n 30 {LOG} 2>/dev/null || echo "(no log output yet)"
echo "============================================================"
echo "Serve command launched in background."
"""


def restore_serve(name: str, run_line: str, capsule: str, cold: str) -> str:
    """Replace the idle container sparkrun just started with one restored from the capsule (same name, labels and
    options, through the coldsnap runtime); when the restore fell back cold, start the server as cold_serve does."""
    q = shlex.quote(name)
    return f"""echo "ColdSnap: restoring {name} from {capsule}"
docker rm -f {q} >/dev/null 2>&1 || true
{run_line} >/dev/null || {{ echo "ColdSnap: the restore failed; its receipt says why" >&2; exit 1; }}
CID=$(docker inspect --format '{{{{.Id}}}}' {q})
SERVE_PID=$(docker exec {q} cat /tmp/sparkrun_serve.pid 2>/dev/null)
if [ -n "$SERVE_PID" ] && docker exec {q} kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "ColdSnap: restored and validated; receipt $CID.json"
    echo "============================================================"
    docker exec {q} tail -n 10 {LOG} 2>/dev/null || true
    echo "============================================================"
    exit 0
fi
echo "ColdSnap: the restore fell back to a cold start (receipt $CID.json says why); starting the server"
{cold}"""
