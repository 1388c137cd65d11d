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
Here: the levels, the probe, the command that starts a sandbox and what it binds; the
sandbox's first process itself is :mod:`.sandbox_root`, the learners' warm parent
:mod:`.zygote`. Standard library only.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from pagedkv_lab.grading.sandbox_root import HOME, LIMITS

__all__ = ["Isolation", "probe", "command", "init_env", "LEARNER_UID", "LIMITS", "SUITE_PACKAGES", "HOME"]

LEVELS = ("full", "namespaces", "none")
# A user id of its own (no passwd entry needed): not `nobody`, whose process count other
# daemons share, and below 65536, which a container's user namespace maps.
LEARNER_UID = int(os.environ.get("PAGEDKV_GRADER_UID", "65533"))
SUITE_PACKAGES = ("pagedkv_lib", "pagedkv_kernels", "pagedkv_lab", "pagedkv_engine")
# Instructor-only modules of the suite: they hold lines of the solutions (planted mistakes).
HIDDEN_MODULES = ("pagedkv_lab/exercises/mistakes", "pagedkv_lab/exercises/instructor_notes")
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


def command(
    level: str,
    root: str,
    argv: list[str] | None = None,
    deadline_s: float = 0,
    env: dict | None = None,
    control_fd: int | None = None,
) -> list[str]:
    """The command that starts a sandbox of ``level`` in the folder ``root`` (an empty
    folder the caller made and removes: at ``full`` and ``namespaces`` a tmpfs is
    mounted on it in the sandbox's own mount namespace, so nothing lands in it; at
    ``none`` it is the learner's home). With ``argv`` (a Python command line,
    ``sys.executable`` first) it runs that, with :func:`learner_env` and ``env``, and
    ends every process it started by ``deadline_s`` seconds; with ``control_fd`` (a
    socket the caller passes) it is a zygote (:mod:`.zygote`). File descriptors the
    caller passes stay open in the learner's process."""
    spec = json.dumps(
        {
            "level": level,
            "mode": "zygote" if control_fd is not None else "exec",
            "root": root,
            "argv": argv,
            "env": learner_env(level, root) | (env or {}),
            "binds": _binds() if level != "none" else [],
            "hide": _hidden() if level != "none" else [],
            "deadline_s": deadline_s,
            "uid": LEARNER_UID,
            "control_fd": control_fd,
        }
    )
    init = [sys.executable, "-m", "pagedkv_lab.grading.sandbox_root", spec]
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
