"""A source's update groups form whatever order its servers take them in.

A server forms its update groups one at a time, in the order the requests reach it (SGLang's scheduler,
`moe-rl serve`'s update thread), and with several sources two servers can take two sources' groups in
crossed orders. Each source's groups must then form independently of each other: over one shared
TCPStore client they formed one after the other (a client runs one request at a time, and a group's
rendezvous waits inside one), and the rehearsal's 4 sources deadlocked with its 2 servers.

Here one source joins two servers that are one process forming the groups one at a time, in a chosen
order: the second server's group first, then the first's (and, in a second round, the other way round).
"""
from __future__ import annotations

import json
import multiprocessing
import queue
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe_rl.rollout.weight_sync import NcclSync, new_custom_group
from moe_rl.rollout.weight_sync import nccl as nccl_mod
from moe_rl.testing import free_port


def _form_in_order(inbox, outbox, order: list[int]) -> None:
    """The servers' update thread, in a process of its own: take both requests, then form the groups one at a
    time in `order`, answering each when it formed."""
    bodies = {}
    while len(bodies) < len(order):
        server, body = inbox.get(timeout=30)
        bodies[server] = body
    for server in order:
        b = bodies[server]
        try:
            new_custom_group(b["backend"], f"tcp://{b['master_address']}:{b['master_port']}", b["world_size"],
                             b["rank_offset"], b["group_name"], timedelta(seconds=8))
            outbox.put((server, True, "Succeeded to initialize custom process group."))
        except Exception as e:  # noqa: BLE001 - the reply says it, as SGLang's does
            outbox.put((server, False, f"Failed to initialize custom process group: {e}."))


class _OneUpdateThread:
    """Two servers' `/init_weights_update_group`, carried out one at a time in `order` (server indices)
    once both requests are in, as one update thread that took them in that order."""

    def __init__(self, order: list[int]):
        ctx = multiprocessing.get_context("fork")  # before any thread of this test starts
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_form_in_order, args=(self.inbox, self.outbox, order), daemon=True)
        self.proc.start()
        self.done: dict[int, tuple[bool, str]] = {}
        self.cond = threading.Condition()

    def init(self, server: int, body: dict) -> tuple[bool, str]:
        self.inbox.put((server, body))
        deadline = time.monotonic() + 60
        with self.cond:
            while server not in self.done and time.monotonic() < deadline:
                try:  # whichever handler thread reads an answer files it for its server
                    got, ok, msg = self.outbox.get(timeout=0.05)
                    self.done[got] = (ok, msg)
                    self.cond.notify_all()
                except queue.Empty:
                    self.cond.wait(0.05)
            return self.done.get(server, (False, "not formed"))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join(5)


def _serve(thread: _OneUpdateThread, server: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            ok, msg = thread.init(server, body) if self.path == "/init_weights_update_group" else (True, "Success")
            raw = json.dumps({"success": ok, "message": msg}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("order", [[1, 0], [0, 1]], ids=["second-server-first", "first-server-first"])
def test_a_source_forms_its_groups_in_the_order_its_servers_take_them(order, monkeypatch):
    thread = _OneUpdateThread(order)
    # The source starts joining the group the servers form first half a second after the other: the
    # thread order that deadlocked (the other group's rendezvous already waits on the shared client).
    real = nccl_mod.new_custom_group

    def later_for_the_first(*args):
        if args[4].endswith(f"-s{order[0]}"):
            time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(nccl_mod, "new_custom_group", later_for_the_first)
    servers = [_serve(thread, i) for i in range(2)]
    sync = NcclSync([f"http://127.0.0.1:{s.server_port}" for s in servers], master_address="127.0.0.1",
                    master_port=free_port(), backend="gloo", group_timeout=timedelta(seconds=8))
    t0 = time.monotonic()
    try:
        sync.connect()  # over one shared store client: the first group's rendezvous blocks the second's
        took = time.monotonic() - t0
        assert len(sync._pgs) == 2 and sorted(thread.done) == [0, 1]
        assert all(ok for ok, _ in thread.done.values()), thread.done
        assert took < 6, f"the groups formed one after the other's timeout ({took:.1f} s)"
    finally:
        sync.close()
        for s in servers:
            s.shutdown()
        thread.stop()
