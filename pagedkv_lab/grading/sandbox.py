"""Where a learner's code runs when it is graded, and with what rights.

Three levels, the best this machine allows (:func:`probe`), each printed by the
grading command (:attr:`Isolation.summary`):

* ``full`` (root, ``unshare`` works): the learner's process runs in new network (no
  interface: no network at all), mount, PID, IPC and UTS namespaces, as a user of its
  own (:data:`LEARNER_UID`, no supplementary groups, no capabilities, ``no_new_privs``),
  chrooted into a fresh tmpfs that holds read-only binds of the system's ``/usr``, a few
  files of ``/etc``, the Python environment and the suite's four packages, and nothing
  else: not the course (``source/``, the gradebook, ``nbgrader_config.py``, the other
  learners), not the checkout (``exercises/solutions/``, ``.git``), not the instructor's
  files. Its home and ``/tmp`` are small tmpfs folders that vanish with it. It sees
  only its own processes; when it ends, or its deadline passes, the kernel ends every
  process it started. Limits: :data:`LIMITS`;
* ``namespaces`` (no root, but user namespaces): the same namespaces and root
  filesystem inside a user namespace; the learner's code keeps the grader's user id
  (no separate user) and holds no capabilities;
* ``none``: a plain child process in a temporary folder, with the limits (a process
  count only where it can be bounded) and a deadline, but the grader's rights: it can
  read and write whatever the grader can. The grade still cannot be forged from the
  learner's namespace (:mod:`pagedkv_lab.grading.remote`), but the solutions and the
  course are open to it: grade in a container.

``PAGEDKV_GRADER_ISOLATION=namespaces`` (or ``none``) asks for at most that level.
This module runs as the sandbox's first process too (``python -m
pagedkv_lab.grading.sandbox SPEC``), before any learner code: standard library only.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import json
import os
import resource
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Isolation", "probe", "command", "init_env", "LEARNER_UID", "LIMITS", "SUITE_PACKAGES", "HOME"]

LEVELS = ("full", "namespaces", "none")
# A user id of its own (no passwd entry needed): not `nobody`, whose process count other
# daemons share, and below 65536, which a container's user namespace maps.
LEARNER_UID = int(os.environ.get("PAGEDKV_GRADER_UID", "65533"))
HOME = "/home/learner"
SUITE_PACKAGES = ("pagedkv_lib", "pagedkv_kernels", "pagedkv_lab", "pagedkv_engine")
# Instructor-only modules of the suite: they hold lines of the solutions (planted mistakes).
HIDDEN_MODULES = ("pagedkv_lab/exercises/mistakes", "pagedkv_lab/exercises/instructor_notes")
# Per learner process: processes (threads count), open files, a file's size (bytes),
# address space (bytes: torch and Triton's interpreter map about 3 GiB), core dumps.
LIMITS = {
    "RLIMIT_NPROC": 64,
    "RLIMIT_NOFILE": 256,
    "RLIMIT_FSIZE": 64 << 20,
    "RLIMIT_AS": 16 << 30,
    "RLIMIT_CORE": 0,
}
TMPFS_SIZE = "256m"  # each of the learner's home and /tmp
_ETC = ("passwd", "group", "nsswitch.conf", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types")
_NAMESPACES = ("--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child")


@dataclass(frozen=True)
class Isolation:
    """What a learner's process gets here: ``level`` (one of ``full``, ``namespaces``,
    ``none``), ``allowed`` (what was tried and what this machine allowed, in words) and
    ``warning`` ("" at ``full``)."""

    level: str
    allowed: str
    warning: str = ""

    @property
    def summary(self) -> str:
        head = f"isolation of each learner's code: {self.level} ({self.allowed})"
        return head + (f"\nWARNING: {self.warning}" if self.warning else "")


def _unshare() -> str | None:
    return shutil.which("unshare") if sys.platform == "linux" else None


def command(level: str, root: str, argv: list[str], deadline_s: float, env: dict | None = None) -> list[str]:
    """The command that runs ``argv`` (a Python command line, ``sys.executable`` first)
    at ``level``, in the folder ``root`` (an empty folder the caller made and removes:
    at ``full`` and ``namespaces`` a tmpfs is mounted on it in the learner's own mount
    namespace, so nothing lands in it; at ``none`` it is the learner's home), with
    :func:`learner_env` and ``env``. Every process of the learner ends by ``deadline_s``
    seconds. File descriptors the caller passes stay open in the learner's process."""
    spec = json.dumps(
        {
            "level": level,
            "root": root,
            "argv": argv,
            "env": learner_env(level, root) | (env or {}),
            "binds": _binds() if level != "none" else [],
            "hide": _hidden() if level != "none" else [],
            "deadline_s": deadline_s,
            "uid": LEARNER_UID,
        }
    )
    init = [sys.executable, "-m", "pagedkv_lab.grading.sandbox", spec]
    if level == "full":
        return [_unshare(), *_NAMESPACES, *init]
    if level == "namespaces":
        return [_unshare(), "--user", "--map-root-user", *_NAMESPACES, *init]
    return init


def init_env() -> dict[str, str]:
    """The environment of the sandbox's first process: enough to import this module."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": os.pathsep.join(_suite_roots())}


def learner_env(level: str, root: str) -> dict[str, str]:
    """The learner's environment: none of the grader's variables (tokens, paths) but
    the suite's own settings (``PAGEDKV_*``, ``TRITON_*``) and one thread."""
    home = root if level == "none" else HOME
    tmp = root if level == "none" else "/tmp"
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "USER": "learner",
        "LOGNAME": "learner",
        "LANG": "C.UTF-8",
        "TMPDIR": tmp,
        "PYTHONPATH": os.pathsep.join(_suite_roots()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": f"{tmp}/matplotlib",
        "TRITON_CACHE_DIR": f"{tmp}/triton",
    }
    for name, value in os.environ.items():
        if name.startswith(("PAGEDKV_", "TRITON_", "CUDA_VISIBLE")) and not name.startswith("PAGEDKV_GRADER"):
            env[name] = value
    return env


def _package_dirs() -> list[str]:
    found = []
    for name in SUITE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found.append(os.path.realpath(list(spec.submodule_search_locations)[0]))
    return found


def _suite_roots() -> list[str]:
    return sorted({os.path.dirname(p) for p in _package_dirs()})


def _covered(path: str, by: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in by)


def _binds() -> list[str]:
    """Paths bound read-only into the learner's root: the system, the Python, the suite."""
    system = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32") if os.path.lexists(p)]
    system += [f"/etc/{n}" for n in _ETC if os.path.exists(f"/etc/{n}")]
    python = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    user_site = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    python |= {os.path.realpath(p) for p in site.getsitepackages() + user_site if os.path.isdir(p)}
    python.add(os.path.dirname(os.path.realpath(sys.executable)))
    binds = list(system)
    for path in sorted(python) + _package_dirs():
        if not _covered(path, [b for b in binds if not os.path.islink(b)]):
            binds.append(path)
    if os.path.exists("/dev/nvidia0"):  # a GPU: its device files and the driver's /sys and /proc entries
        binds += ["/sys"] + sorted(glob.glob("/dev/nvidia*"))
    return binds


def _hidden() -> list[str]:
    """Files inside the binds that the learner sees empty (instructor-only modules)."""
    hidden = []
    for package_root in _suite_roots():
        for module in HIDDEN_MODULES:
            path = os.path.join(package_root, module + ".py")
            if os.path.exists(path):
                folder, name = os.path.split(path)
                hidden += [path, *glob.glob(os.path.join(folder, "__pycache__", name[:-3] + ".*.pyc"))]
    return hidden


@functools.cache
def probe() -> Isolation:
    """The best level this machine allows, at most ``$PAGEDKV_GRADER_ISOLATION``: each
    level is tried by building its sandbox and starting this Python in it."""
    wanted = os.environ.get("PAGEDKV_GRADER_ISOLATION", "full")
    if wanted not in LEVELS:
        raise ValueError(f"PAGEDKV_GRADER_ISOLATION={wanted!r}: one of {', '.join(LEVELS)}")
    tried = []
    if _unshare() is None:
        tried.append("no unshare(1) here (Linux's util-linux)")
    else:
        for level in LEVELS[LEVELS.index(wanted) : 2]:
            if level == "full" and os.geteuid() != 0:
                tried.append("not root: no user of its own")
                continue
            error = _try(level)
            if not error:
                if level == "full":
                    return Isolation(level, f"root; namespaces net, mount, pid, ipc, uts; user id {LEARNER_UID}")
                tried.append("a user namespace (no user of its own: the learner keeps the grader's user id)")
                return Isolation(level, "; ".join(tried), _WARN_NAMESPACES)
            tried.append(f"{level} refused: {error}")
    if wanted != "full":
        tried.append(f"PAGEDKV_GRADER_ISOLATION={wanted}")
    return Isolation("none", "; ".join(tried), _WARN_NONE)


_WARN_NAMESPACES = (
    "each learner's code runs with your user id (inside its own namespaces and a root filesystem "
    "that holds only the Python and the suite, read-only): run the grading command as root, or in a "
    "container, for a user of its own."
)
_WARN_NONE = (
    "each learner's code runs as a plain process with your rights: it can read the course (source/, "
    "the gradebook), the solutions and your files, and write them. Grades still come from the "
    "checker, not from the learner's notebook; grade in a container (docs/grading.md)."
)


def _try(level: str) -> str:
    """'' when a sandbox of ``level`` starts this Python, else what went wrong."""
    root = tempfile.mkdtemp(prefix="pagedkv-probe-")
    try:
        run = subprocess.run(
            command(level, root, [sys.executable, "-c", "import os; os.getcwd()"], 20),
            env=init_env(),
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = run.stderr.decode(errors="replace").strip().splitlines()
    return "" if run.returncode == 0 else (lines[-1] if lines else f"exit status {run.returncode}")


# --------------------------------------------------------------------------- the first process

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC = 32, 4096, 16384
_ST_TO_MS = {os.ST_NOSUID: _MS_NOSUID, os.ST_NODEV: _MS_NODEV, os.ST_NOEXEC: _MS_NOEXEC}
_ST_TO_MS |= {getattr(os, n): v for n, v in (("ST_NOATIME", 1024), ("ST_NODIRATIME", 2048), ("ST_RELATIME", 1 << 21))}
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


def _build_root(spec: dict) -> None:
    root = spec["root"]
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")
    for path in spec["binds"]:
        target = _place(root, path)
        if not os.path.islink(path):
            _bind_read_only(path, target, device=path.startswith("/dev/"))
    for path in spec["hide"]:
        _mount("/dev/null", root + path, None, _MS_BIND)
    os.makedirs(root + "/dev/shm")
    for name in ("null", "zero", "full", "random", "urandom"):
        _bind_read_only(f"/dev/{name}", _place(root, f"/dev/{name}"), device=True)
    for name, to in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(to, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    owner = spec["uid"] if spec["level"] == "full" else 0
    for path, mode in (("/tmp", "1777"), (HOME, "0700"), ("/dev/shm", "1777")):
        os.makedirs(root + path, exist_ok=True)
        _mount("tmpfs", root + path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode},size={TMPFS_SIZE}")
        os.chown(root + path, owner, owner)
    _mount(None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "mode=0755,size=4m")


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


def _init(spec: dict) -> int:
    """Build the root, start the learner's process in it and wait for it (the first
    process of the PID namespace: when it returns, the kernel ends every other one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec["level"] != "none":
        _build_root(spec)
        os.chroot(spec["root"])
    os.chdir(HOME if spec["level"] != "none" else spec["root"])
    child = os.fork()
    if child == 0:
        try:
            _limit(spec)
            _become_learner(spec)
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        finally:
            os._exit(127)
    if spec["level"] == "full":
        _become_learner(spec)
    deadline = time.monotonic() + spec["deadline_s"]
    while time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)  # reaps orphans too
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number, as a shell says
        if pid == 0:
            time.sleep(0.05)
    if spec["level"] == "none":
        os.killpg(0, signal.SIGKILL)
    return 124


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    try:
        code = _init(_spec)
    except OSError as err:
        print(f"pagedkv sandbox: {err}", file=sys.stderr)
        code = 125
    sys.stdout.flush()
    os._exit(code)
