"""Ports chosen for a process that binds them later: drawn below the kernel's ephemeral range, never handed out twice,
and a port taken anyway is one clear error in the vLLM engine core's view of dvi's loop."""

from __future__ import annotations

import socket

import pytest

from dvi import procs
from dvi.cli import vllm_loop
from dvi.cli.vllm_plugin import PORT
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
    low = procs.ephemeral_range()[0]
    ports = [procs.free_port() for _ in range(40)]
    assert all(procs.FIRST_PORT <= p < low for p in ports), ports
    assert len(set(ports)) == len(ports)
    for p in ports[:5]:
        listening(p).close()  # each one free to bind


def test_a_port_in_use_is_passed_over_and_an_exhausted_range_falls_back_to_an_ephemeral_port():
    first = procs.FIRST_PORT
    held = []
    try:
        for p in (first, first + 1):
            try:
                held.append(listening(p))
            except OSError:
                pytest.fail(f"port {p} is in use on this host; the test needs it free")
        assert procs.free_port(ephemeral=(first + 3, 60999)) == first + 2  # the only one left below the range
        assert procs.free_port(ephemeral=(first + 3, 60999)) >= procs.ephemeral_range()[0]  # none left: as before
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
