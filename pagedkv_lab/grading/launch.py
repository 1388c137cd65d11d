"""Starting a learner's process for the checker (:class:`~.remote.LearnerProcess`):
forked by the zygote where the machine allows namespaces (:mod:`.zygote`, one per
grading process and isolation level, started on first use), else started on its own
(``python -m pagedkv_lab.grading.learner`` in a plain child, level ``none``).

Either way the checker gets a :class:`Launched`: the write end of the learner's request
pipe, the read end of its answer pipe, and ways to kill it and to learn how it ended
(an exit code; 128 + a signal; 124 at its deadline; 125 when the sandbox itself failed).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import warnings

from pagedkv_lab.grading import sandbox

__all__ = ["Launched", "launch", "SANDBOX_FAILED"]

SANDBOX_FAILED = 125


class Launched:
    """A started learner process (see the module docstring)."""

    requests_fd: int
    answers_fd: int

    def kill(self) -> None:
        """End it and every process it started."""
        raise NotImplementedError

    def exit_code(self, timeout_s: float) -> int | None:
        """How it ended (see the module docstring), or None if it still runs after ``timeout_s``."""
        raise NotImplementedError

    def problem(self) -> str:
        """The sandbox's own complaint (its last line on stderr), "" if none."""
        raise NotImplementedError

    def close(self) -> None:
        for fd in (self.requests_fd, self.answers_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _last_line(stream) -> str:
    stream.seek(0)
    lines = stream.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


class _OnItsOwn(Launched):
    """A sandbox of its own for one learner (``sandbox.command`` with ``argv``)."""

    def __init__(self, isolation: sandbox.Isolation, deadline_s: float, output_fd: int) -> None:
        self._root = tempfile.mkdtemp(prefix="pagedkv-grading-")
        self._stderr = tempfile.TemporaryFile()
        argv = [sys.executable, "-P", "-m", "pagedkv_lab.grading.learner"]
        env = {"PAGEDKV_OUTPUT_FD": str(output_fd)}
        self._proc = subprocess.Popen(
            sandbox.command(isolation.level, self._root, argv, deadline_s, env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=sandbox.init_env(),
            start_new_session=True,
            pass_fds=(output_fd,),
        )
        self.requests_fd, self.answers_fd = os.dup(self._proc.stdin.fileno()), os.dup(self._proc.stdout.fileno())
        self._proc.stdin.close()
        self._proc.stdout.close()

    def kill(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # unshare, or the plain learner and its group
            except ProcessLookupError:
                pass
        self._proc.wait()

    def exit_code(self, timeout_s: float) -> int | None:
        try:
            code = self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        return code if code >= 0 else 128 - code

    def problem(self) -> str:
        return _last_line(self._stderr)

    def close(self) -> None:
        self.kill()
        super().close()
        self._stderr.close()
        shutil.rmtree(self._root, ignore_errors=True)


class _Zygote:
    """A running zygote (:mod:`.zygote`) and the socket to it."""

    def __init__(self, isolation: sandbox.Isolation) -> None:
        self.root = tempfile.mkdtemp(prefix="pagedkv-zygote-")
        self.stderr = tempfile.TemporaryFile()
        self.socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            sandbox.command(isolation.level, self.root, control_fd=theirs.fileno()),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
            env=sandbox.init_env(),
            start_new_session=True,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()

    def ask(self, request: dict, fds: tuple = (), timeout_s: float = 120) -> dict:
        """The zygote's answer to ``request``; RuntimeError if it is gone or mute."""
        self.socket.settimeout(timeout_s)
        try:
            socket.send_fds(self.socket, [json.dumps(request).encode()], list(fds))
            answer = self.socket.recv(1 << 16)
        except OSError as err:
            answer, problem = b"", str(err)
        else:
            problem = ""
        if not answer:
            self.proc.poll()
            raise RuntimeError(f"the grading sandbox's zygote ended: {_last_line(self.stderr) or problem}")
        return json.loads(answer)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.socket.close()  # the zygote exits, and with it every learner
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stderr.close()
        shutil.rmtree(self.root, ignore_errors=True)


_ZYGOTES: dict[str, _Zygote] = {}
_NO_ZYGOTE: set[str] = set()  # levels whose zygote failed to start in this process


@atexit.register
def _close_zygotes() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()
    _ZYGOTES.clear()


class _Forked(Launched):
    """A learner forked by the zygote."""

    def __init__(self, zygote: _Zygote, deadline_s: float, output_fd: int, preload: tuple) -> None:
        self._zygote = zygote
        theirs_r, self.requests_fd = os.pipe()
        self.answers_fd, theirs_w = os.pipe()
        try:
            # the first start waits for the zygote's imports
            request = {"op": "start", "deadline_s": deadline_s, "preload": list(preload)}
            self._pid = zygote.ask(request, (theirs_r, theirs_w, output_fd))["pid"]
        finally:
            os.close(theirs_r)
            os.close(theirs_w)
        self._code: int | None = None

    def kill(self) -> None:
        if self._code is None:
            self._code = self._zygote.ask({"op": "kill", "pid": self._pid})["status"]

    def exit_code(self, timeout_s: float) -> int | None:
        if self._code is None:
            self._code = self._zygote.ask({"op": "wait", "pid": self._pid, "timeout_s": timeout_s})["status"]
        return self._code

    def problem(self) -> str:
        return _last_line(self._zygote.stderr)

    def close(self) -> None:
        if self._zygote.alive():
            self.kill()
        super().close()


def launch(isolation: sandbox.Isolation, deadline_s: float, output_fd: int, preload: tuple = ()) -> Launched:
    """A learner process at ``isolation``, whose every process ends by ``deadline_s``
    seconds, its stdout and stderr going to ``output_fd``; ``preload``: modules the
    zygote imports first, once (where there is one)."""
    if isolation.level == "none" or isolation.level in _NO_ZYGOTE:
        return _OnItsOwn(isolation, deadline_s, output_fd)
    zygote = _ZYGOTES.get(isolation.level)
    if zygote is None or not zygote.alive():
        zygote = _ZYGOTES[isolation.level] = _Zygote(isolation)
    try:
        return _Forked(zygote, deadline_s, output_fd, preload)
    except RuntimeError as err:  # no zygote here: each learner then starts its own Python, as at level none
        warnings.warn(f"{err}; each learner's process starts on its own (slower)", stacklevel=2)
        _NO_ZYGOTE.add(isolation.level)
        _ZYGOTES.pop(isolation.level).close()
        return _OnItsOwn(isolation, deadline_s, output_fd)
