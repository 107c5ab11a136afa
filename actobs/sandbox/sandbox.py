"""
A sandbox: a container with a task's limits (CPUs, memory, processes, disk: disk.py) and a tmux terminal that takes
keystrokes and returns observations (Terminus-2 semantics); always removed. The terminal needs bash, tmux and
coreutils' `timeout` in the image. envs.py runs episodes on it; docs/sandboxes.md.
"""
import re
import time

from actobs.sandbox import disk
from actobs.sandbox import network as net
from actobs.sandbox.container_files import changes, overlay_dirs, put_files
from actobs.sandbox.daemon import LABEL, SandboxError, docker_client, host_cpus, owner_label
from actobs.sandbox.images import STANDIN_ONLINE
from actobs.terminus import (MAX_DURATION, OUTPUT_HEADER, SCREEN_HEADER, decode, pane_diff, truncate_output,
                             visible_screen)

SCREEN = (160, 40)  # tmux window (columns, rows)
PAUSED = b"cannot exec in a paused container"  # the runtime's refusal of a command in a frozen sandbox
DEFAULT_STORAGE_MB = 10240  # disk budget when a task names none (Harbor's default)
STEP_READS = 3  # reads of a terminal step's result file when its exec's output came back incomplete
# How long a terminal step may run past its duration before it is killed (and its episode lost to the
# infrastructure): its own tmux calls take milliseconds on an idle host, seconds in a CPU-starved container (dozens of
# sandboxes on two cores)
STEP_SLACK_S = 60.0

# ----------------------------------------------------------------------------------------------------------
# Sandbox: one container + one tmux terminal inside it

# Runs once per sandbox as the task's user. PROMPT_COMMAND writes a counter and the expanded prompt each
# time bash is about to show its prompt: the step script uses that to know the shell is back and idle.
# Control files and tmux's socket live in /dev/shm, so an agent's `rm -rf /tmp/*` does not cut the terminal.
TERMINAL_SETUP = r"""
d=/dev/shm/.actobs-$(id -u); mkdir -p "$d"
cat > "$d/rc" <<'RC'
[ -f /etc/bash.bashrc ] && . /etc/bash.bashrc
[ -f ~/.bashrc ] && . ~/.bashrc
PS1='\u@\h:\w\$ '
set -o ignoreeof
__actobs_n=0
__actobs_prompt() {
    __actobs_n=$((__actobs_n+1)); printf "%s\n%s\n" "$__actobs_n" "${PS1@P}" >| /dev/shm/.actobs-$UID/prompt
}
PROMPT_COMMAND=__actobs_prompt
RC
printf 'set -g history-limit 10000\nset -g status off\n' > "$d/tmux.conf"
tmux -S "$d/tmux" -f "$d/tmux.conf" new-session -d -s main -x "$1" -y "$2" "bash --rcfile $d/rc -i"
tmux -S "$d/tmux" display -p -t main '#{pane_pid}' > "$d/shellpid"
for i in $(seq 500); do [ -s "$d/prompt" ] && exit 0; sleep 0.01; done
echo "shell prompt did not appear" >&2; exit 1
"""

# One docker exec per terminal step: send the keys, wait (at most $3 seconds) until bash is the terminal's
# foreground process again, has redrawn its prompt (counter moved, when a newline was typed) and the pane's
# last line is that prompt; then, if $5 is 1, capture the state and the pane (history + screen) and clear
# tmux's history so the next capture only holds new lines. State `exited`: the agent's shell is gone (it typed
# `exit`, or killed the shell or tmux). The result, headed by the step's number ($6) and its length in bytes, is
# printed and also kept in $d/step: under load an exec can end with status 0 and its output lost on the way, and
# the keys must not be typed twice, so Sandbox._step then reads the file with a second exec.
TERMINAL_STEP = r"""
d=/dev/shm/.actobs-$UID; keys=$1; literal=$2; wait_s=$3; newline=$4; seq=$6
tmux() { command tmux -S "$d/tmux" "$@"; }
emit() {
    LC_ALL=C; printf '%s %s\n%s' "$seq" "${#1}" "$1" >| "$d/step"; printf '%s %s\n%s' "$seq" "${#1}" "$1"; exit 0
}
gone() { emit "exited 0 1"$'\n'; }
read -r shell 2>/dev/null < "$d/shellpid" && [ -d "/proc/$shell" ] || gone
{ read -r c0; read -r _; } < "$d/prompt"
if [ "$literal" = 1 ]; then
  while [ -n "$keys" ]; do tmux send-keys -t main -l -- "${keys:0:2000}" 2>/dev/null || gone; keys=${keys:2000}; done
elif [ -n "$keys" ]; then
  tmux send-keys -t main "$keys" 2>/dev/null || gone
fi
t=${EPOCHREALTIME/./}; end=$(( t + 10#${wait_s/./} * 1000 )); state=busy; n=0; nap=0.001
exec {never}<> <(:)  # a pipe nobody writes: `read -t` on it is a sleep without forking a process
while :; do
  { read -r c; read -r p; } < "$d/prompt"
  if [ "$newline" = 0 ] || [ "$c" != "$c0" ]; then
    read -r -a st 2>/dev/null < "/proc/$shell/stat" || gone
    if [ "${st[7]}" = "$shell" ]; then
      scr=$(tmux capture-pane -p -t main 2>/dev/null); last=${scr##*$'\n'}  # $(...) drops the empty trailing rows
      p=${p%"${p##*[! ]}"}
      if [ "$last" = "$p" ]; then state=idle; break; fi
    fi
  fi
  [ "${EPOCHREALTIME/./}" -ge "$end" ] && break
  read -t "$nap" -u "$never"; ((++n > 20)) && nap=0.005
done
[ -d "/proc/$shell" ] || gone
if [ "$5" = 1 ]; then
  out=$(tmux display -p -t main "$state #{history_size} #{history_limit}" \; capture-pane -p -S - -E - -t main \; \
        clear-history -t main 2>/dev/null && printf .) || gone
  emit "${out%.}"  # the dot keeps the pane's trailing newlines through $(...)
fi
emit "$state 0 1"$'\n'
"""
STEP_SHELL = "step"  # $0 of TERMINAL_STEP's bash: its own errors read "step: ..." (a fork it could not make, e.g.)

# /etc/hosts of a sandbox not on the host's network (printf's escapes), as Docker writes it for one with a network
HOSTS = r"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tsandbox\n"

# PID 1 of every sandbox: bash with every catchable signal ignored. The kernel never delivers SIGKILL/SIGSTOP
# from inside the container to its init, so nothing the agent does (`kill -9 -1`, `kill 1`) stops the
# container, and bash reaps the orphans it adopts (daemons the agent leaves behind).
INIT = 'trap "" HUP INT QUIT TERM USR1 USR2; while :; do sleep 86400 & wait; done'

# Run as root before the verifier: SIGKILL to every process but init and this shell (kill(-1) is atomic
# against fork: a process forking while it runs is killed with its child), then check that nothing but init,
# init's sleep and this shell's own children is left (zombies are dead already; D-state ones get a moment).
STOP_AGENT = r"""
kill -9 -1 2>/dev/null
for i in {1..100}; do
  left=
  for f in /proc/[0-9]*/stat; do
    read -r st 2>/dev/null < "$f" || continue
    pid=${st%% *}; comm=${st#* (}; comm=${comm%) *}; rest=(${st##*) })
    [ "$pid" = 1 ] || [ "$pid" = $$ ] || [ "${rest[0]}" = Z ] || [ "${rest[1]}" = $$ ] && continue
    [ "${rest[1]}" = 1 ] && [ "$comm" = sleep ] && continue
    left+=" $pid($comm)"
  done
  [ -z "$left" ] && exit 0
  sleep 0.05
done
echo "still running after SIGKILL:$left"; exit 1
"""


class ShellExited(SandboxError):
    """The agent's shell is gone: it typed `exit`, or killed the shell or tmux. The agent's doing."""


class DiskLimit(SandboxError):
    """The sandbox wrote more than its disk budget; its processes were killed."""


class ProcessLimit(SandboxError):
    """The agent's processes hold every process slot of the sandbox (a fork bomb): the terminal cannot run."""


class Sandbox:
    """A container with the task's limits and a tmux terminal; use as a context manager (always removed).
    storage_mb, inodes: the disk budget of the container's writable layer, its bytes and its entries (disk.Budget: what
    holds it on each kind of daemon; inodes None: its default for storage_mb).
    network: None (no network: only loopback), "egress" (the internet through NAT, nothing of the host's nor of
    another sandbox: network.py) or "host" (the host's network namespace, its local services included: not
    isolated)."""

    def __init__(self, image, *, workdir="/app", user="root", cpus=1.0, memory_mb=2048, storage_mb=DEFAULT_STORAGE_MB,
                 inodes=None, pids=1024, network=None, files=(), tmpfs=()):
        self.image, self.workdir, self.user = image, workdir, user
        self.tmpfs = tmpfs  # folders mounted as tmpfs (exec, root's): scratch space outside the disk budget
        self.cpus, self.memory_mb, self.storage_mb = cpus, memory_mb, storage_mb
        if network not in (None, net.EGRESS, net.HOST):
            raise ValueError(f"network {network!r}: none (None), {net.EGRESS!r} or {net.HOST!r}")
        self.pids, self.network, self.files = pids, network, files
        self.container = None
        self.address = None  # on the egress network: the sandbox's IPv4 address (network.attach)
        self.disk = disk.Budget(storage_mb, inodes)
        self._start = 0  # pane line where the next observation begins
        self._anchor = ""  # that line's text when it was read
        self.last_idle = False
        self._steps = 0  # terminal steps run: each step's result carries its number
        self.recovered_steps = 0  # reads of a step's result file after its exec's output went missing

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        t0 = time.time()
        import docker
        env = {"LANG": "C.UTF-8"}
        if self.network and "UV_OFFLINE=1" in (docker_client().images.get(self.image).attrs["Config"].get("Env") or []):
            env.update(STANDIN_ONLINE)
        # Created, then started: a container that fails to start is still ours to remove (close()).
        self.container = docker_client().containers.create(
            # The image's own entrypoint is replaced: the container only has to stay up for our execs. PID 1 is
            # bash (INIT). A fixed hostname keeps prompts and observations reproducible from the seed.
            self.image, entrypoint=["bash", "-c", INIT], labels={LABEL: owner_label()},
            # Every sandbox not on the host's network is NetworkDisabled, so that dockerd makes no libnetwork
            # endpoint (the container still gets a network namespace of its own, loopback only; egress is plumbed into
            # it below). On a shared network, two containers torn down at once can deadlock Debian 12's docker.io
            # 20.10.24 for good (moby/libnetwork#2649; a CI run saw it on "none").
            hostname="sandbox", network_mode="host" if self.network == net.HOST else "none",
            network_disabled=self.network != net.HOST,
            mem_limit=f"{self.memory_mb}m",
            memswap_limit=f"{self.memory_mb}m", pids_limit=self.pids, nano_cpus=int(host_cpus(self.cpus) * 1e9),
            working_dir=self.workdir, environment=env, tmpfs={path: "exec,mode=700" for path in self.tmpfs},
            **self.disk.create_options())
        self.disk.limit(self.container)  # before anything runs in it
        try:
            self.container.start()
        except docker.errors.APIError as e:
            raise SandboxError(f"{self.image}: the container did not start (the image needs bash): "
                               f"{e.explanation}") from None
        upper = (overlay_dirs(self.container) or (None,))[0]  # None: the daemon is asked (slower)
        self.disk.watch(self.container, upper)
        # Harbor tasks expect these to exist and be writable by the agent's user.
        setup = f"mkdir -p {self.workdir} /logs/agent /logs/verifier && chmod 777 /logs/agent /logs/verifier"
        # Docker writes no /etc/hosts or /etc/resolv.conf for a NetworkDisabled container: localhost and the hostname
        # resolve as they would with a network, and names through the host's name servers with egress
        if self.network != net.HOST:
            setup += f" && printf '{HOSTS}' > /etc/hosts"
        if self.network == net.EGRESS:
            egress = net.ensure()
            self.address = net.attach(self.container, egress)
            servers = "".join(f"nameserver {s}\\n" for s in egress.nameservers)
            setup += f" && rm -f /etc/resolv.conf && printf '{servers}' > /etc/resolv.conf"
        code, out = self.exec(setup, user="root")
        if code != 0:
            raise SandboxError(f"{self.image}: could not prepare the container: {decode(out)[-300:]}")
        if self.files:
            put_files(self.container, self.files)
        self._start_terminal()
        self.start_s = time.time() - t0

    def _start_terminal(self):
        code, out = self.exec(["bash", "-c", TERMINAL_SETUP, "setup", str(SCREEN[0]), str(SCREEN[1])])
        if code != 0:
            raise SandboxError(f"terminal did not start in {self.image} (needs bash and tmux): {decode(out)}")

    def restart_terminal(self):
        """A new terminal after stop_agent killed the old one; returns its first screen (as screen())."""
        self.exec(["bash", "-c", "rm -rf /dev/shm/.actobs-*"], user="root")  # the old prompt file would fool setup
        self._start_terminal()
        self._start, self._anchor = 0, ""
        return self.screen()

    def stop_agent(self):
        """Kill every process the agent could have started (the terminal, daemons, setsid/nohup children). The
        kill runs the container's bash, which the agent may have replaced: the container's process count, as the
        daemon reads it from the cgroup, must then come down to init and its sleep."""
        code, out = self.exec(["bash", "-c", STOP_AGENT], user="root")
        if code != 0:
            raise SandboxError(f"agent processes could not be stopped: {decode(out)[-300:]}")
        for _ in range(20):  # the last killed ones may take a moment to be reaped
            left = self._pids()
            if left <= 2:
                return
            time.sleep(0.05)
        raise SandboxError(f"{left - 2} processes left after stopping the agent (was its bash replaced?)")

    @property
    def disk_exceeded(self):
        """Why the disk watch stopped the sandbox, or that it fell behind (then the sandbox counts as over), or ""."""
        return self.disk.exceeded or self.disk.stale()

    def changes(self):
        """{path: "C" or "A"}: what changed in the sandbox since its image (container_files.changes), walked within
        its inode budget and disk.WALK_DEADLINE_S; past them LayerLimit (the sandbox counts as over its budget)."""
        return changes(self.container, self.disk.inodes, time.monotonic() + disk.WALK_DEADLINE_S)

    def close(self):
        self.disk.close()
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception:
                pass  # already gone; the start-up sweep catches anything the daemon kept
            self.container = None

    def exec(self, cmd, *, user=None, timeout=None, env=None):
        """Run a command; `timeout` runs it under coreutils timeout because exec_run itself cannot time out.
        env: variables added to (or replacing) the image's."""
        if isinstance(cmd, str):
            cmd = ["bash", "-c", cmd]
        if timeout is not None:
            cmd = ["timeout", "-k", "2", str(timeout)] + cmd
        # The disk watch freezes the sandbox while it walks the layer at rest (disk.Budget): the runtime refuses to
        # start a process in it then, and the command never ran, so it starts again once the walk thawed the sandbox
        # (a walk is bounded by WALK_DEADLINE_S, its freeze and thaw by FREEZE_S each). Only where a freeze of the
        # watch's overlapped the command: a command of the agent's that prints the refusal and exits 126 runs once.
        deadline = time.monotonic() + disk.WALK_DEADLINE_S + 2 * disk.FREEZE_S
        while True:
            frozen, freezes = self.disk.frozen, self.disk.freezes
            res = self.container.exec_run(cmd, user=user or self.user, workdir=self.workdir,
                                          environment={"LANG": "C.UTF-8", **(env or {})})
            watched = frozen or self.disk.frozen or self.disk.freezes != freezes
            if res.exit_code != 126 or PAUSED not in res.output or not watched or time.monotonic() > deadline:
                return res.exit_code, res.output
            time.sleep(0.05)

    def _shell_gone(self):
        """True only when a probe ran and found no shell (a probe that cannot even start says nothing)."""
        code, out = self.exec(["bash", "-c", 'read -r p 2>/dev/null < /dev/shm/.actobs-$UID/shellpid && '
                               '[ -d /proc/$p ] && echo alive || echo gone'])
        return out.strip() == b"gone"

    def _pids(self):
        """Processes in the container, from its cgroup (no program of the container is asked)."""
        return self.container.stats(stream=False, one_shot=True).get("pids_stats", {}).get("current", 0)

    def _pids_full(self):
        return self._pids() >= 0.95 * self.pids

    def screen(self):
        """Initial observation: the visible screen; also marks the read position for the first diff."""
        screen, _ = self._step("", 5.0, read=True)  # returns as soon as the first prompt is drawn
        return SCREEN_HEADER + screen

    def send(self, keystrokes, duration=1.0, read=True):
        """Type keystrokes (Terminus-2 semantics) and wait until the shell is idle, at most `duration` seconds.
        With read=True return the observation: all output since the last read (a reply's commands are read
        once, after the last one, as Terminus-2 does)."""
        screen, diff = self._step(keystrokes, min(max(float(duration), 0.0), MAX_DURATION), read)
        if not read:
            return None
        # limited with its header, as Terminus-2 limits what it reads
        if diff is None or not diff.strip():
            return truncate_output(SCREEN_HEADER + screen)
        return truncate_output(OUTPUT_HEADER + diff)

    def _step_result(self, out):
        """The step's result without its head (step number, length), or None if `out` is not all of this step's."""
        head, _, body = out.partition(b"\n")
        if head.split() != [str(self._steps).encode(), str(len(body)).encode()]:
            return None
        return decode(body)

    def _step(self, keystrokes, duration, read):
        # A keystroke string that is exactly a tmux key name (C-c, Enter, Up...) is a key; all else is text.
        literal = "0" if re.fullmatch(r"(C-|M-|S-)+\S|Enter|Escape|Tab|BSpace|Up|Down|Left|Right|Home|End|"
                                      r"PageUp|PageDown|PPage|NPage|F\d{1,2}|Space|DC|IC", keystrokes) else "1"
        newline = "1" if ("\n" in keystrokes or "\r" in keystrokes or literal == "0") else "0"
        self._steps += 1
        code, out = self.exec(["bash", "-c", TERMINAL_STEP, STEP_SHELL, keystrokes, literal, f"{duration:.3f}",
                               newline, "1" if read else "0", str(self._steps)], timeout=duration + STEP_SLACK_S)
        result = self._step_result(out)
        for _ in range(STEP_READS if result is None and code == 0 else 0):  # ran, but its output went missing
            self.recovered_steps += 1
            result = self._step_result(self.exec(["bash", "-c", "cat /dev/shm/.actobs-$UID/step"])[1])
            if result is not None:
                break
        text = decode(out) if result is None else result
        header, _, pane = text.partition("\n")
        fields = header.split()
        if self.disk_exceeded:
            raise DiskLimit(self.disk_exceeded)
        if code != 0 and self._shell_gone():
            fields = ["exited"]  # e.g. the agent's `kill -9 -1` also killed this step
        failed = fields[:1] == ["exited"] or code != 0 or len(fields) != 3
        if failed and (self._pids_full() or (code != 0 and re.search(rf"^{STEP_SHELL}: fork: ", text, re.M))):
            # The step itself could not fork: the agent's processes hold them all. Checked first, as a tmux call that
            # cannot fork reads as a gone terminal in TERMINAL_STEP (`exited`) while the shell is still there. The
            # step's own shell (STEP_SHELL) saying so is enough: a bomb's count swings below the limit as its
            # processes die, so the count read afterwards can miss it (a CI run did).
            raise ProcessLimit(f"all {self.pids} processes of the sandbox in use; terminal step failed "
                               f"(exit {code}): {text[-300:]}")
        if fields[:1] == ["exited"]:
            raise ShellExited("the agent's shell exited (exit, or its shell or tmux was killed)")
        if code != 0 or len(fields) != 3:
            raise SandboxError(f"terminal step failed (exit {code}): {text[-500:]}")
        self.last_idle = fields[0] == "idle"  # whether the step ended early on an idle prompt
        if not read:
            return None, None
        lines = pane.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        hist, limit = int(fields[1]), int(fields[2])
        diff = pane_diff(lines, self._start, self._anchor)
        if diff is None and hist >= 0.8 * limit:
            # tmux drops the oldest 10% of a full history: the start scrolled out during this step, all that is
            # kept is new output (its head is cut, as truncation would cut it anyway).
            diff = "\n" + "\n".join(lines).rstrip()
        # After clear-history the visible screen is all that is left; remember its last non-empty line.
        visible = lines[hist:]
        last = max((i for i, ln in enumerate(visible) if ln.strip()), default=0)
        self._start, self._anchor = last, visible[last].rstrip() if visible else ""
        return visible_screen(lines, SCREEN[1]), diff
