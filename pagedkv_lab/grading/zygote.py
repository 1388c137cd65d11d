"""The zygote: one warm Python per grading run, inside the sandbox's root, from which
each learner's process is forked, so that a learner costs a fork instead of a Python
start and a torch import (2-3 s on an idle 2-core machine, up to 9 s on a busy one).

It imports the suite (:data:`PRELOAD`, and what a start request names) before any
learner code exists, holds nothing of
the course (it lives in the sandbox's root, which has none), and answers the grader on
a socket (``spec["control_fd"]``, SOCK_SEQPACKET, one JSON message each way):

* ``{"op": "start", "deadline_s", "preload"}`` with three file descriptors (the learner's request
  and answer pipes and its output file): forks the learner's process in namespaces of
  its own (:func:`~.sandbox_root.enter_learner_namespaces`: new mount, PID, network, IPC
  and UTS namespaces, a fresh home and ``/tmp``), as the learner's user, under
  :func:`~.sandbox_root.supervise`; answers ``{"pid"}``;
* ``{"op": "wait", "pid", "timeout_s"}``: answers ``{"status"}``, the learner's exit code
  (128 + a signal), or None if it is still running;
* ``{"op": "kill", "pid"}``: kills it (and so its whole PID namespace); answers as ``wait``.

When the grader closes the socket, the zygote exits, and with it every learner.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import time
import traceback

from pagedkv_lab.grading import sandbox_root

__all__ = ["serve", "PRELOAD"]

# What every learner's set-up cell imports, in its order (the backend first): imported
# before the first learner; a start request may name more (Triton, for the kernel exercises).
PRELOAD = ("pagedkv_lib.runtime", "torch", "pagedkv_lab.exercises", "pagedkv_lab.grading.learner")


def _preload(names) -> None:
    for name in names:
        try:
            importlib.import_module(str(name))
        except ImportError:  # Triton is not everywhere; a learner's own import then says so
            pass


_FIRST: dict[int, int] = {}  # a learner's outer process -> the first process of its PID namespace


def _start(spec: dict, control: socket.socket, request: dict, fds: list[int]) -> int:
    """Fork one learner (see the module docstring); returns the pid of its outer process."""
    told, tell = os.pipe()
    pid = os.fork()
    if pid:
        os.close(tell)
        with os.fdopen(told, "rb") as said:
            first = said.read()
        if first:
            _FIRST[pid] = int(first)
        return pid
    try:  # the learner's outer process: new namespaces, then their first process
        os.close(told)
        control.close()
        requests, answers, output = fds
        for fd in range(3, 1024):  # nothing of the zygote's open files reaches the learner
            if fd not in (*fds, tell):
                try:
                    os.close(fd)
                except OSError:
                    pass
        learner = dict(spec, deadline_s=float(request["deadline_s"]))
        sandbox_root.enter_learner_namespaces(learner)
        first = os.fork()
        if first == 0:
            sandbox_root.die_with_parent()
            sandbox_root.mount_proc()
            from pagedkv_lab.grading.learner import serve

            os.close(tell)
            os._exit(sandbox_root.supervise(learner, lambda: serve(requests, answers, output)))
        os.write(tell, str(first).encode())
        os.close(tell)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(first, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    except BaseException:  # noqa: BLE001  (the sandbox failed: the grader's problem, said on stderr)
        traceback.print_exc()
        os._exit(125)


_EXITED: dict[int, int] = {}  # exit codes of the zygote's children, reaped but not yet asked for


def _reap() -> None:
    """Reap every child that ended: the learners' outer processes, and the first
    processes of their namespaces that a killed outer process left to the zygote."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        _EXITED[pid] = code if code >= 0 else 128 - code


def _wait(pid: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + max(0.0, min(float(timeout_s), 60.0))
    while True:
        _reap()
        if pid in _EXITED:
            _FIRST.pop(pid, None)
            return _EXITED.pop(pid)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def serve(spec: dict) -> None:
    """Preload the suite, then answer the grader until it closes the socket."""
    _preload(PRELOAD)
    control = socket.socket(fileno=spec["control_fd"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1 << 16, 3)
        except OSError:
            break
        if not message:
            break
        request = json.loads(message)
        if request["op"] == "start":
            _preload(request.get("preload", ()))
            reply = {"pid": _start(spec, control, request, fds)}
            for fd in fds:
                os.close(fd)
        elif request["op"] == "kill":
            pid = int(request["pid"])
            for target in (_FIRST.pop(pid, None), pid):  # the namespace's first process ends the namespace
                try:
                    os.kill(target, signal.SIGKILL) if target else None
                except ProcessLookupError:
                    pass
                status = _wait(pid, 10)
                if status is not None:
                    break
            reply = {"status": status}
        else:
            reply = {"status": _wait(int(request["pid"]), request.get("timeout_s", 0))}
        control.send(json.dumps(reply).encode())
        _reap()
