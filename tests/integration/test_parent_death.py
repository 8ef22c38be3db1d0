"""Children die with their parent, even a SIGKILLed one (Linux PR_SET_PDEATHSIG).

Claims: SIGKILLing `python -m dynamo.nats_server` takes its nats-server along and
frees the port; SIGKILLing a `launch/` script leaves none of its descendants (NATS wrapper
and server, frontend, mocker) running; the exec wrapper (`python -m
dynamo.runtime.parent_death -- CMD`) keeps CMD's pid, ties it to the wrapper's parent and
refuses to run CMD when that parent is already gone; `preexec_die_with_parent` ties a
`Popen` child; `children_die_with_this_process` ties forked children (what vLLM's engine
core is), and a grandchild is tied to its own parent, not to the first process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

from dynamo.runtime.nats_address import is_reachable
from dynamo.runtime.parent_death import supported
from dynamo.runtime.ports import free_port
from dynamo.testing.processes import child_env, start_launch_script, wait_serving
from dynamo.testing.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0
"""How soon a tied child must be gone after its parent was killed (SIGKILL is at once;
SIGTERM lets a frontend or mocker shut down, which takes a second or two)."""

pytestmark = pytest.mark.skipif(not supported(), reason="PR_SET_PDEATHSIG is Linux only")


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie nobody reaped yet (in a container the
    reaper of orphans may be slow or absent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_all_gone(pids: Sequence[int], what: str) -> None:
    def described() -> str:
        alive = [p for p in pids if not gone(p)]
        names = []
        for pid in alive:
            try:
                names.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        return f"{what}; still running: {names}"

    wait_until(lambda: all(gone(p) for p in pids), timeout=GONE_WITHIN_S, what=described)


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Pids a test started, directly or not: whatever is left is killed afterwards, so a
    failing test does not leave processes behind either."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


def spawn(argv: Sequence[str], log: Path, **kwargs: object) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env=child_env(), **kwargs
        )


def read_pids(path: Path, count: int) -> list[int]:
    """Wait until `path` holds `count` pids, one per line."""

    def ready() -> list[int] | None:
        try:
            lines = path.read_text().split()
        except OSError:
            return None
        return [int(x) for x in lines] if len(lines) >= count else None

    wait_until(ready, timeout=20, what=f"{count} pids in {path}", interval=0.05)
    return [int(x) for x in path.read_text().split()][:count]


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------- nats_server


def test_sigkilled_nats_server_wrapper_takes_its_server_along(
    tmp_path: Path, reap: list[int]
) -> None:
    port = free_port()
    wrapper = spawn(
        [sys.executable, "-m", "dynamo.nats_server", "--port", str(port)],
        tmp_path / "wrapper.log",
    )
    reap.append(wrapper.pid)

    def server_child() -> psutil.Process | None:
        assert wrapper.poll() is None, (tmp_path / "wrapper.log").read_text()
        children = psutil.Process(wrapper.pid).children()
        return children[0] if children and is_reachable(f"nats://127.0.0.1:{port}") else None

    wait_until(server_child, timeout=20, what="the wrapper's nats-server", interval=0.05)
    server = server_child()
    assert server is not None and "nats-server" in server.name()
    reap.append(server.pid)

    wrapper.kill()
    wrapper.wait(5)
    wait_all_gone([server.pid], "nats-server after its wrapper was SIGKILLed")
    wait_until(lambda: port_is_free(port), timeout=5, what=f"port {port} to be free")
    assert not is_reachable(f"nats://127.0.0.1:{port}")


# --------------------------------------------------------------------------- launch scripts


def test_sigkilled_launch_script_leaves_nothing_behind(
    tmp_path: Path, embedded_model: Path, reap: list[int]
) -> None:
    http_port = free_port()
    env = {
        "HTTP_PORT": str(http_port),
        "MODEL": str(embedded_model),
        "SERVED_MODEL_NAME": "pdeath-model",
        "NUM_WORKERS": "1",
        "ROUTER_MODE": "round-robin",
        "LOG_DIR": str(tmp_path / "logs"),
        "PYTHON": sys.executable,
        "MOCKER_ARGS": "--speed-up 50",
    }
    (tmp_path / "logs").mkdir()
    # its own group: the test's cleanup can find it
    script = start_launch_script(
        ROOT / "launch" / "mocker.sh", env, tmp_path / "script.log", new_session=True
    )
    reap.append(script.pid)
    try:
        base = f"http://127.0.0.1:{http_port}"
        wait_serving(base, "pdeath-model", [], timeout=60)
        descendants = psutil.Process(script.pid).children(recursive=True)
        reap.extend(p.pid for p in descendants)
        commands = [" ".join(p.cmdline()) for p in descendants]
        for part in (
            "dynamo.nats_server",
            "nats-server",
            "dynamo.frontend",
            "dynamo.mocker",
        ):
            assert any(part in c for c in commands), f"no {part} among {commands}"

        script.kill()  # no trap runs: only the kernel can tell the children
        script.wait(5)
        wait_all_gone([p.pid for p in descendants], "the launch script's processes")
    except BaseException:
        print((tmp_path / "script.log").read_text(errors="replace"))
        for log in sorted((tmp_path / "logs").glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")
        raise


# --------------------------------------------------------------------------- the exec wrapper


def test_exec_wrapper_keeps_the_pid_and_ties_the_command_to_the_parent(
    tmp_path: Path, reap: list[int]
) -> None:
    pid_file = tmp_path / "pids"
    shell = spawn(
        [
            "bash",
            "-c",
            f'"{sys.executable}" -m dynamo.runtime.parent_death --parent-pid $$ -- sleep 300 & '
            f"echo $! > {pid_file}; wait",
        ],
        tmp_path / "shell.log",
    )
    reap.append(shell.pid)
    (child,) = read_pids(pid_file, 1)
    reap.append(child)
    wait_until(
        lambda: psutil.Process(child).name() == "sleep",
        timeout=10,
        what="the wrapper to exec sleep under its own pid",
    )
    shell.kill()
    shell.wait(5)
    wait_all_gone([child], "the wrapped command after its parent shell was SIGKILLed")


def test_exec_wrapper_does_not_run_the_command_when_the_parent_is_gone(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    marker = tmp_path / "ran"
    result = subprocess.run(
        [sys.executable, "-m", "dynamo.runtime.parent_death", "--parent-pid", str(dead.pid),
         "--", "touch", str(marker)],
        env=child_env(),
        timeout=30,
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM
    assert not marker.exists()


def test_exec_wrapper_errors(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "dynamo.runtime.parent_death"]
    no_command = subprocess.run([*run, "--"], capture_output=True, text=True, timeout=30)
    assert no_command.returncode == 2 and "no command" in no_command.stderr
    missing = subprocess.run(
        [*run, "--", str(tmp_path / "nope")], capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 127 and "cannot run" in missing.stderr
    bad_signal = subprocess.run(
        [*run, "--signal", "NOPE", "--", "true"], capture_output=True, text=True, timeout=30
    )
    assert bad_signal.returncode == 2 and "not a signal name" in bad_signal.stderr


# --------------------------------------------------------------------------- in-process APIs


def test_popen_child_dies_with_its_parent(tmp_path: Path, reap: list[int]) -> None:
    pid_file = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        from dynamo.runtime.parent_death import preexec_die_with_parent
        child = subprocess.Popen(["sleep", "300"], preexec_fn=preexec_die_with_parent())
        open({str(pid_file)!r}, "w").write(f"{{child.pid}}\\n")
        time.sleep(300)
    """)
    parent = spawn([sys.executable, "-c", code], tmp_path / "parent.log")
    reap.append(parent.pid)
    (child,) = read_pids(pid_file, 1)
    reap.append(child)
    parent.kill()
    parent.wait(5)
    wait_all_gone([child], "a Popen child after its parent was SIGKILLed")


def test_forked_children_and_grandchildren_die_with_their_parents(
    tmp_path: Path, reap: list[int]
) -> None:
    pid_file = tmp_path / "pids"
    code = textwrap.dedent(f"""
        import multiprocessing, os, signal, time
        from dynamo.runtime.parent_death import children_die_with_this_process

        def grandchild():
            time.sleep(300)

        def child():
            grand = multiprocessing.get_context("fork").Process(target=grandchild)
            grand.start()
            time.sleep(0.5)  # a grandchild wrongly tied to the first process dies at once
            with open({str(pid_file)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n{{grand.pid}}\\n" if grand.is_alive() else "0\\n0\\n")
            time.sleep(300)

        children_die_with_this_process(signal.SIGKILL)
        multiprocessing.get_context("fork").Process(target=child).start()
        time.sleep(300)
    """)
    parent = spawn([sys.executable, "-c", code], tmp_path / "parent.log")
    reap.append(parent.pid)
    child, grandchild = read_pids(pid_file, 2)
    assert child and grandchild, "the grandchild died with the wrong parent check"
    reap.extend([child, grandchild])
    assert not gone(child) and not gone(grandchild)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(5)
    wait_all_gone([child, grandchild], "forked descendants after the parent was SIGKILLed")


SPAWNER = """
import multiprocessing, os, signal, sys, time
from multiprocessing.shared_memory import SharedMemory
from dynamo.runtime.parent_death import spawned_children_die_with_this_process


def child(path):
    shm = SharedMemory(create=True, size=4096)  # registered with the resource tracker
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {shm.name}\\n")
    time.sleep(300)


if __name__ == "__main__":
    spawned_children_die_with_this_process(signal.SIGKILL)
    multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],)).start()
    time.sleep(300)
"""


def test_spawned_children_die_and_the_resource_tracker_cleans_up(
    tmp_path: Path, reap: list[int]
) -> None:
    """What vLLM does with its engine core: a `spawn`ed child dies with its parent, and
    the resource tracker, deliberately not tied, outlives both and unlinks the shared
    memory the child leaked."""
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    out = tmp_path / "child"
    parent = spawn([sys.executable, str(script), str(out)], tmp_path / "parent.log")
    reap.append(parent.pid)

    def child_info() -> list[str] | None:
        assert parent.poll() is None, (tmp_path / "parent.log").read_text()
        text = out.read_text() if out.exists() else ""
        return text.split() if text.endswith("\n") else None

    wait_until(child_info, timeout=30, what="the spawned child to start", interval=0.05)
    pid_text, shm_name = child_info() or ["0", ""]
    child = int(pid_text)
    reap.append(child)
    segment = Path("/dev/shm") / shm_name.lstrip("/")
    assert segment.exists()
    parent.kill()
    parent.wait(5)
    wait_all_gone([child], "a spawned child after its parent was SIGKILLed")
    wait_until(
        lambda: not segment.exists(), timeout=GONE_WITHIN_S, what=f"{segment} to be unlinked"
    )
