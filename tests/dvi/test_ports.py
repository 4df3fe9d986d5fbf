"""Ports chosen for a process that binds them later: drawn below the kernel's ephemeral range, never handed out twice,
and a port taken anyway is one clear error in the vLLM engine core's view of dvi's loop."""

from __future__ import annotations

import signal
import socket

import pytest

from dvi import procs
from dvi.cli.vllm import loop as vllm_loop
from dvi.cli.vllm.plugin import PORT
from dvi.errors import DviError


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(procs, "_given", set())


def listening(port: int) -> socket.socket:
    s = socket.socket()
    s.bind((procs.HOST, port))
    s.listen()
    return s


def test_ports_are_drawn_below_the_ephemeral_range_and_never_twice():
    ports = [procs.free_port(ephemeral=(procs.FIRST_PORT + 1000, 60999)) for _ in range(40)]
    assert all(procs.FIRST_PORT <= p < procs.FIRST_PORT + 1000 for p in ports), ports
    assert len(set(ports)) == len(ports)
    for p in ports[:5]:
        listening(p).close()  # each one free to bind


def test_a_port_in_use_is_passed_over_and_an_exhausted_range_falls_back_to_an_ephemeral_port(monkeypatch):
    base = next(b for b in range(procs.FIRST_PORT, procs.FIRST_PORT + 2000, 3)
                if not any(procs.port_in_use(p) for p in (b, b + 1, b + 2)))
    monkeypatch.setattr(procs, "FIRST_PORT", base)
    held = [listening(base), listening(base + 1)]
    try:
        assert procs.free_port(ephemeral=(base + 3, 60999)) == base + 2  # the only one left below the range
        fallback = procs.free_port(ephemeral=(base + 3, 60999))  # none left: bind(0), as before
        assert fallback not in (base, base + 1, base + 2), fallback
    finally:
        for s in held:
            s.close()


def test_the_ephemeral_range_is_read_from_the_kernels_file(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert procs.ephemeral_range(f) == (40000, 50000)
    f.write_text("junk")
    assert procs.ephemeral_range(f) is None
    assert procs.ephemeral_range(tmp_path / "absent") is None


def test_a_loop_that_cannot_start_stops_the_vllm_process_that_started_it(monkeypatch, caplog):
    killed = []
    monkeypatch.setattr(vllm_loop.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    parent = type("Parent", (), {"pid": vllm_loop.os.getppid()})()
    monkeypatch.setattr(vllm_loop.multiprocessing, "parent_process", lambda: parent)
    vllm_loop.stop_server(DviError("no view"))
    assert killed == [(parent.pid, signal.SIGTERM)]
    assert "dvi's loop could not start: no view; stopping vLLM's server" in caplog.text

    killed.clear()  # not started by a process that still is its parent (a launcher gone, Ray's worker): none signalled
    monkeypatch.setattr(vllm_loop.multiprocessing, "parent_process", lambda: None)
    vllm_loop.stop_server(DviError("no view"))
    parent.pid = parent.pid + 1
    monkeypatch.setattr(vllm_loop.multiprocessing, "parent_process", lambda: parent)
    vllm_loop.stop_server(DviError("no view"))
    assert killed == []


class _Replica:
    closed = False

    def close(self):
        self.closed = True


def test_the_loops_view_on_a_taken_port_is_one_clear_error_and_the_replica_is_closed(monkeypatch):
    port = procs.free_port()
    with listening(port):
        monkeypatch.setenv(PORT, str(port))
        replica = _Replica()
        with pytest.raises(DviError, match=rf"127\.0\.0\.1:{port} \({PORT}\).*another process holds that port"):
            vllm_loop._Loop(replica)
        assert replica.closed
