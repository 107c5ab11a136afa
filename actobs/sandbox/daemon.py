"""
The Docker daemon as the sandbox side shares it: one client (DOCKER_HOST, else .ci/dockerd.sh's private daemon), the
label every sandbox carries and the sweep of those left behind, the base image's name, the host's CPUs, and the
sandbox side's error. Importing it needs no daemon. docs/sandboxes.md.
"""
import os
import socket
import sys
import threading

BASE_IMAGE = "actobs-base:bookworm"  # the generated tasks' image (images.build_base_image)
PRIVATE_SOCKET = os.environ.get("ACTOBS_DOCKER_ROOT", "/var/lib/actobs-docker") + "/docker.sock"
LABEL = "actobs.sandbox"  # every container carries it; value = "<hostname>:<pid>" of the owning process

_client, _client_lock = None, threading.Lock()
_cpus, _warned = None, set()


class SandboxError(RuntimeError):
    pass


def docker_env():
    """The environment of a docker CLI call and of the SDK's client: this process's, with DOCKER_HOST set to
    .ci/dockerd.sh's private daemon where no other is named and the default socket is not there."""
    if "DOCKER_HOST" in os.environ or os.path.exists("/var/run/docker.sock") or not os.path.exists(PRIVATE_SOCKET):
        return dict(os.environ)
    return dict(os.environ, DOCKER_HOST=f"unix://{PRIVATE_SOCKET}")


def docker_client():
    """One shared client; its HTTP pool is sized for many concurrent sandboxes (the SDK default is 10)."""
    global _client
    with _client_lock:
        if _client is None:
            import docker  # imported lazily: importing this module must not need a daemon
            env = docker_env()
            try:
                _client = docker.from_env(environment=env, max_pool_size=128, timeout=600)
            except docker.errors.DockerException as e:
                raise RuntimeError(f"no Docker daemon at {env.get('DOCKER_HOST', 'the default socket')} ({e}); "
                                   "start one with `. .ci/dockerd.sh start`") from None
        return _client


def host_cpus(cpus):
    """cpus capped to what the Docker host has (Docker refuses more), with a warning once per value."""
    global _cpus
    if _cpus is None:
        _cpus = docker_client().info()["NCPU"]
    if cpus > _cpus and cpus not in _warned:
        _warned.add(cpus)
        print(f"warning: a task asks for {cpus:g} CPUs, the Docker host has {_cpus}; using {_cpus}", file=sys.stderr)
    return min(cpus, _cpus)


def owner_label(pid=None):
    """The LABEL value of the containers process `pid` on this host owns (default: this process)."""
    return f"{socket.gethostname()}:{pid or os.getpid()}"


def sweep():
    """Remove leftover sandboxes: those whose owning process on this host is gone (killed runs, crashed tests).
    Returns how many removals Docker answered with success."""
    removed = 0
    import docker
    # sparse: no inspect per container, which would race with other processes removing theirs
    for c in docker_client().containers.list(all=True, sparse=True, filters={"label": LABEL}):
        host, _, pid = (c.attrs.get("Labels") or {}).get(LABEL, "").rpartition(":")
        if host != socket.gethostname():
            continue
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        try:
            c.remove(force=True)
            removed += 1
        except docker.errors.APIError as e:
            if e.status_code not in (404, 409):  # gone, or another process's sweep is removing it (Conflict)
                raise
    return removed


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def my_containers(pid=None):
    """Containers owned by process `pid` (default: this process; tests assert this is empty after every episode)."""
    return docker_client().containers.list(all=True, sparse=True, filters={"label": f"{LABEL}={owner_label(pid)}"})


def image_exists(tag):
    import docker
    try:
        docker_client().images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False
