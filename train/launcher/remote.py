"""Several hosts: the launcher on host 0 gathers the others' (`gather_hosts`, `admit_returning`), which start the
processes it asks for and report their ends (`follow`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

from train.launcher.command import LaunchConfig
from train.launcher.hosts import POLL, child_env, die_with_parent
from train.launcher.orphan import LAUNCHER_ENV

HELLO_TIMEOUT = 30.0
"""Seconds host 0 waits for a connecting launcher's first line."""


FOLLOWING: dict = {}
"""The training processes a following launcher runs (`follow`), for its signal handler."""


class RemoteHost:
    """Host 0's end of another host's launcher: starts and signals training processes there and learns when they
    end (JSON lines over TCP, `follow` on the other end). A host whose launcher disconnects is lost: each of
    its running processes then counts as killed (SIGKILL)."""

    def __init__(self, sock, index: int):
        import threading

        self.sock, self.index, self.alive = sock, index, True
        self.children: dict[int, RemoteChild] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"launch-host-{index}", daemon=True).start()

    def send(self, message: dict) -> None:
        try:
            with self._lock:
                self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            self._lose()

    def start(self, slot: int, command: list[str], env: dict[str, str]) -> RemoteChild:
        """Starts ``command`` in ``slot`` there, with ``env`` added to that host's environment where it does not
        set those variables itself."""
        child = self.children[slot] = RemoteChild(self, slot)
        if not self.alive:
            child.returncode = -signal.SIGKILL
        self.send({"op": "start", "slot": slot, "command": command, "env": env})
        return child

    def _read(self) -> None:
        with self.sock.makefile("r") as lines:
            try:
                for line in lines:
                    message = json.loads(line)
                    child = self.children.get(message.get("slot"))
                    if child is not None and "exit" in message:
                        child.returncode = int(message["exit"])
            except (OSError, ValueError):
                pass
        self._lose()

    def _lose(self) -> None:
        self.alive = False
        for child in self.children.values():
            if child.returncode is None:
                child.returncode = -signal.SIGKILL


class RemoteChild:
    """A training process on another host (the part of `subprocess.Popen` the launcher uses), told about by
    that host's launcher (`RemoteHost`)."""

    def __init__(self, host: RemoteHost, slot: int):
        self.host, self.slot, self.pid, self.returncode = host, slot, None, None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            self.host.send({"op": "signal", "slot": self.slot, "signal": int(signum)})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"process in slot {self.slot} on host {self.host.index}", timeout)
            time.sleep(0.05)
        return self.returncode


def gather_hosts(launch: LaunchConfig, timeout: float, log: Callable[[str], None]) -> dict[int, RemoteHost]:
    """On host 0: waits for every other host's launcher to connect to ``--launch-port``. With ``--rejoin`` it
    keeps listening afterwards (`admit_returning`): a host whose launcher is started again takes its place.

    Raises:
      RuntimeError: A host did not connect within ``timeout`` seconds (``--dist-timeout``), or said an index
        outside the job.
    """
    import socket

    server = socket.create_server(("", launch.launch_port), reuse_port=False)
    server.settimeout(1.0)
    remotes: dict[int, RemoteHost] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(remotes) < launch.hosts - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, launch.hosts)) - set(remotes))
                raise RuntimeError(
                    f"--dist-timeout {timeout:.0f}: host(s) {', '.join(map(str, missing))} did not connect to "
                    f"--launch-port {launch.launch_port} on {launch.placement.coordinator}; start one launcher per host"
                )
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            index = _hello(sock, launch)
            if index in remotes:
                sock.close()
                raise RuntimeError(f"two launchers said they are host {index}; give each host its own index")
            remotes[index] = RemoteHost(sock, index)
            log(f"launch: host {index} of {launch.hosts} connected")
    except BaseException:
        server.close()
        raise
    if not launch.rejoin:
        server.close()
        return remotes
    import threading

    threading.Thread(
        target=admit_returning, args=(server, launch, remotes, log), name="launch-admit", daemon=True
    ).start()
    return remotes


def _hello(sock, launch: LaunchConfig) -> int:
    """Reads a connecting launcher's first line and returns its host index.

    Raises:
      RuntimeError: An index outside the job, or other flags than this launcher's (the socket is closed).
    """
    sock.settimeout(HELLO_TIMEOUT)
    hello = json.loads(sock.makefile("r").readline() or "{}")
    sock.settimeout(None)
    index = hello.get("host")
    if not isinstance(index, int) or not 0 < index < launch.hosts:
        sock.close()
        raise RuntimeError(f"a launcher said it is host {index!r}; expected one of 1..{launch.hosts - 1}")
    if hello.get("local_processes") != launch.local_processes:
        sock.close()
        raise RuntimeError(
            f"host {index} runs --local-processes {hello.get('local_processes')}, host 0 "
            f"{launch.local_processes}: give every launcher the same flags"
        )
    return index


def admit_returning(server, launch: LaunchConfig, remotes: dict[int, RemoteHost], log: Callable[[str], None]) -> None:
    """On host 0 with ``--rejoin``, for the rest of the job: a launcher started again on a host whose launcher
    went away takes that host's place in ``remotes``, so its slots are reachable again and the job grows back
    onto them at the next checkpoint boundary (`Launcher.watch`). A launcher for a host still connected, or
    with other flags, is turned away with one line."""
    while True:
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:  # the server was closed
            return
        try:
            index = _hello(sock, launch)
        except (RuntimeError, OSError, ValueError) as e:
            log(f"launch: turned a connecting launcher away: {e}")
            continue
        if index in remotes and remotes[index].alive:
            sock.close()
            log(f"launch: turned away a second launcher for host {index}: its first is still connected")
            continue
        remotes[index] = RemoteHost(sock, index)
        log(f"launch: host {index} of {launch.hosts} connected again; its processes rejoin at the next checkpoint")


def follow(launch: LaunchConfig, timeout: float, log: Callable[[str], None]) -> int:
    """On a host other than 0: connects to host 0's launcher and runs the training processes it asks for on
    this host, telling it when each ends, until host 0's launcher says the job ended (its exit status is
    returned) or disconnects (`LOST_LAUNCHER`)."""
    import select
    import socket

    where = launch.placement
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((where.coordinator, launch.launch_port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"--launch-port {launch.launch_port}: no launcher answers on host 0 ({where.coordinator}) "
                    f"within --dist-timeout {timeout:.0f} s ({e})"
                ) from e
            time.sleep(0.5)
    sock.settimeout(None)
    sock.sendall((json.dumps({"host": where.index, "local_processes": launch.local_processes}) + "\n").encode())
    log(f"launch: host {where.index} of {where.count} connected to {where.coordinator}:{launch.launch_port}")
    children: dict[int, subprocess.Popen] = {}
    env, buffer = child_env(os.environ), b""
    FOLLOWING.update(children=children)
    try:
        while True:
            for slot, child in list(children.items()):
                if child.poll() is not None:
                    del children[slot]
                    sock.sendall((json.dumps({"slot": slot, "exit": child.returncode}) + "\n").encode())
            if not select.select([sock], [], [], POLL)[0]:
                continue
            data = sock.recv(65536)
            if not data:
                log(f"error: the launcher on host 0 ({where.coordinator}) went away; stopping this host's processes")
                return LOST_LAUNCHER
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                message = json.loads(line)
                if message["op"] == "start":
                    extra = {k: v for k, v in message.get("env", {}).items() if k not in env}
                    own = {LAUNCHER_ENV: str(os.getpid())}  # this host's launcher is the one its children watch
                    child = subprocess.Popen(message["command"], env=env | extra | own, preexec_fn=die_with_parent)
                    children[message["slot"]] = child
                    index = message["command"][message["command"].index("--process-id") + 1]
                    count = message["command"][message["command"].index("--num-processes") + 1]
                    log(f"launch: process {index} of {count} (slot {message['slot']}) started, pid {child.pid}")
                elif message["op"] == "signal" and message["slot"] in children:
                    children[message["slot"]].send_signal(message["signal"])
                elif message["op"] == "end":
                    return int(message["code"])
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
        sock.close()


LOST_LAUNCHER = 3
"""Exit status of a launcher on host 1.. whose host 0 launcher went away (as a training process that lost a peer)."""


def pass_on(signum, frame) -> None:
    """SIGTERM or SIGINT to a following launcher: passed to its training processes (they save and end)."""
    for child in FOLLOWING.get("children", {}).values():
        if child.poll() is None:
            child.send_signal(signum)
