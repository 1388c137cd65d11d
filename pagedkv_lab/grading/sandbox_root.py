"""The sandbox's first process: ``python -m pagedkv_lab.grading.sandbox_root SPEC``,
started by :func:`pagedkv_lab.grading.sandbox.command` inside new namespaces (or, at
level ``none``, as a plain child), before any learner code. Standard library only.

It builds the learner's root filesystem (a read-only tmpfs of read-only binds, see
:mod:`.sandbox`), enters it, and then either

* ``"mode": "exec"``: starts one learner process (``argv``) and waits for it, or
* ``"mode": "zygote"``: becomes the zygote (:mod:`.zygote`), which forks each learner's
  process from one warm Python, each in namespaces of its own
  (:func:`enter_learner_namespaces`).

Either way :func:`supervise` starts the learner: resource limits, the learner's user
(or, in a user namespace, no capabilities), ``no_new_privs``, and a deadline after which
it and everything it started is killed (the first process of a PID namespace returns,
and the kernel ends the rest).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time
from collections.abc import Callable

__all__ = ["build_root", "enter_learner_namespaces", "supervise", "HOME", "LIMITS"]

HOME = "/home/learner"
# Per learner process: processes (threads count), open files, a file's size (bytes),
# address space (bytes; torch and Triton's interpreter map about 1 GiB; not on a machine
# with an NVIDIA GPU, where CUDA reserves far more), core dumps.
LIMITS = {
    "RLIMIT_NPROC": 64,
    "RLIMIT_NOFILE": 256,
    "RLIMIT_FSIZE": 64 << 20,
    "RLIMIT_AS": 16 << 30,
    "RLIMIT_CORE": 0,
}
TMPFS_SIZE = "256m"  # each of the learner's home and /tmp

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC = 32, 4096, 16384
_ST_TO_MS = {os.ST_NOSUID: _MS_NOSUID, os.ST_NODEV: _MS_NODEV, os.ST_NOEXEC: _MS_NOEXEC}
_ST_TO_MS |= {getattr(os, n): v for n, v in (("ST_NOATIME", 1024), ("ST_NODIRATIME", 2048), ("ST_RELATIME", 1 << 21))}
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x00020000,
    0x04000000,
    0x08000000,
    0x20000000,
    0x40000000,
)
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    if _libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source or fstype} on {target}: {os.strerror(err)}")


def _bind_read_only(source: str, target: str, device: bool = False) -> None:
    _mount(source, target, None, _MS_BIND | _MS_REC)
    kept = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(target).f_flag & st)  # locked in a user namespace
    _mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | (0 if device else _MS_NODEV) | kept)


def _place(root: str, path: str) -> str:
    """Create ``path``'s mount point (or symbolic link) inside ``root``; returns it."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
    elif os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    return target


def _scratch_mounts(spec: dict, root: str = "") -> None:
    """Fresh, small tmpfs folders for the learner's home, ``/tmp`` and ``/dev/shm``.

    A bind that lies inside one of them (a checkout or venv under ``/tmp``) would be
    hidden by the fresh tmpfs: it is held open (``O_PATH``) across the mount and bound
    again from its descriptor, its own hidden files with it (a recursive bind)."""
    owner = spec["uid"] if spec["level"] == "full" else 0
    for path, mode in (("/tmp", "1777"), (HOME, "0700"), ("/dev/shm", "1777")):
        os.makedirs(root + path, exist_ok=True)
        inside = [b for b in spec["binds"] if b.startswith(path + "/") and not os.path.islink(root + b)]
        held = [(b, os.open(root + b, os.O_PATH)) for b in inside]
        _mount("tmpfs", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size={TMPFS_SIZE}")
        os.chown(root + path, owner, owner)
        for b, fd in held:
            target = root + b
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "w").close()
            _bind_read_only(f"/proc/self/fd/{fd}", target)
            os.close(fd)


def build_root(spec: dict) -> None:
    """Mount the learner's root filesystem on ``spec["root"]`` (see :mod:`.sandbox`)."""
    root = spec["root"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")
    for path in spec["binds"]:
        target = _place(root, path)
        if not os.path.islink(path):
            _bind_read_only(path, target, device=path.startswith("/dev/"))
    for path in spec["hide"]:
        _mount("/dev/null", root + path, None, _MS_BIND)
    for name in ("null", "zero", "full", "random", "urandom"):
        _bind_read_only(f"/dev/{name}", _place(root, f"/dev/{name}"), device=True)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(to, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _scratch_mounts(spec, root)
    _mount(None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")


def enter_learner_namespaces(spec: dict) -> None:
    """In a process forked from the zygote (inside the root): new mount, PID, network,
    IPC and UTS namespaces, with a fresh home, ``/tmp`` and ``/dev/shm``. The next child
    is the first process of the new PID namespace and must mount ``/proc``
    (:func:`mount_proc`)."""
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    _scratch_mounts(spec)


def mount_proc() -> None:
    """``/proc`` of this process's PID namespace (its first process calls it)."""
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)


def die_with_parent() -> None:
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """No capability now or after exec: bounding set emptied, ambient cleared, root's
    exec-time capabilities switched off and locked (securebits), the sets cleared."""
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        _libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    _libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    _libc.prctl(28, 0x2F, 0, 0, 0)  # PR_SET_SECUREBITS: NOROOT, NO_SETUID_FIXUP, KEEP_CAPS locked
    if _libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _limit(spec: dict) -> None:
    for name, value in LIMITS.items():
        if name == "RLIMIT_NPROC" and spec["level"] == "none":
            continue  # it would count every process of the grader's user
        if name == "RLIMIT_AS" and os.path.exists("/dev/nvidia0"):
            continue
        resource.setrlimit(getattr(resource, name), (value, value))
    cpu = int(spec["deadline_s"]) + 5
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def _become_learner(spec: dict) -> None:
    if spec["level"] == "full":
        os.setgroups([])
        os.setresgid(spec["uid"], spec["uid"], spec["uid"])
        os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    elif spec["level"] == "namespaces":
        _drop_capabilities()
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no set-user-id program gives rights back


def supervise(spec: dict, learner: Callable[[], None]) -> int:
    """Fork the learner's process (limits, its user, its home, then ``learner()``, which
    must not return) and wait for it until ``spec["deadline_s"]`` has passed; returns its
    exit code (128 + the signal that killed it), or 124 at the deadline."""
    child = os.fork()
    if child == 0:
        try:
            _limit(spec)
            _become_learner(spec)
            os.chdir(HOME if spec["level"] != "none" else spec["root"])
            learner()
        finally:
            os._exit(127)
    if spec["level"] == "full":
        _become_learner(spec)
    deadline = time.monotonic() + spec["deadline_s"]
    while time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)  # reaps orphans too
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code
        if pid == 0:
            time.sleep(0.02)
    if spec["level"] == "none":
        os.killpg(0, signal.SIGKILL)
    return 124


def _main(spec: dict) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec["level"] != "none":
        build_root(spec)
        os.chroot(spec["root"])
        os.chdir("/")
    if spec["mode"] == "zygote":
        os.environ.clear()
        os.environ.update(spec["env"])
        from pagedkv_lab.grading import zygote  # after the chroot: imported from the learner's root

        zygote.serve(spec)
        return 0
    return supervise(spec, lambda: os.execve(spec["argv"][0], spec["argv"], spec["env"]))


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    try:
        code = _main(_spec)
    except OSError as err:
        print(f"pagedkv sandbox: {err}", file=sys.stderr)
        code = 125
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
