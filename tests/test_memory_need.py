"""Memory said before it is spent: every task says the bytes a volunteer holds at once for it
(``nodes.engine.protocol.Protocol.memory``), and a volunteer whose memory control group cannot
give that declines, saying why, instead of being killed by the kernel mid-task. Under a real
cgroup limit (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) around a real trainer process."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from nodes import launch
from nodes.coordinator.coordinator import Coordinator
from nodes.engine.protocol import Protocol
from nodes.settings import Settings
from nodes.volunteer import channel, memory
from nodes.volunteer.thin_app import relay
from nodes.wire import read_reply, task_content

from .federation_kit import fingerprint, make_federation

MB = 2**20
# a byte-level GPT of 6.6M parameters under local AdamW: 126 MB held at once
SETTINGS = Settings(dataset="pystdlib", model="gpt:layers=2,width=512,heads=8,context=64", rounds=1,
                    protocol="delta:steps=1,inner=adamw", lr=0.003, batch_size=2, aggregator="mean", tolerate=0,
                    quorum=1, deadline=120.0)


def test_a_task_says_what_it_needs_and_node_join_what_this_machine_can_serve(tmp_path):
    assert Protocol.parse("delta:inner=adamw", lr=0.1, momentum=0.9, batch_size=1).memory(10) == \
        {"model": 40, "training": 120, "gradient": 40}
    assert sum(Protocol.parse("delta", lr=0.1, momentum=0.9, batch_size=1).memory(10).values()) == 160
    coord = Coordinator(make_federation(tmp_path, 1, SETTINGS)[0])
    task, w = coord.task()
    assert task.memory == 5 * 4 * w.size == 5 * 4 * 6_600_960
    assert memory.capacity(600 * MB) == ("the parameters, gradient and optimiser state of models up to 39M "
                                         "parameters (local SGD) or 31M parameters (AdamW)")
    room, bound = memory.available()
    assert 0 < room and bound


def _memory_group(name: str) -> tuple[Path, str, str]:
    """A memory control group of this process's hierarchy: ``(its folder, its limit file, its use file)``."""
    for group, version in memory.groups():
        if version == "v1":  # a child of this process's own group
            made = group / name
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        elif "memory" in (memory.CGROUP / "cgroup.subtree_control").read_text().split():
            made = memory.CGROUP / name  # v2: a child of the root (a group with processes has no children)
            files = ("memory.max", "memory.current")
        else:
            continue
        try:
            made.mkdir()
        except OSError as err:
            pytest.skip(f"cannot make a memory control group ({err}): run as root on Linux")
        return made, *files
    pytest.skip("this machine has no memory control group to limit (cgroup v1 or v2 `memory`)")


def test_a_volunteer_declines_a_task_its_memory_limit_cannot_hold_and_trains_one_it_can(tmp_path):
    folder, nodes = make_federation(tmp_path, 1, SETTINGS)
    coord, node = Coordinator(folder), nodes[0]
    group, limit, use = _memory_group(f"robust-test-{os.getpid()}")
    proc = None
    try:
        proc = launch.start_trainer(node, node / "trainer.log", setup={
            "device": "cpu", "dataset": "pystdlib", "root": None, "part": "1/1", "attack": "", "slow": 0.0,
            "code": ""}, wrap=["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh"])
        _ready(proc, node)
        assert "MB free (its memory control group" not in (node / "trainer.log").read_text()  # no limit yet
        tasks, w = coord.tasks([fingerprint(node)])
        task = tasks[fingerprint(node)]
        held = int((group / use).read_text())
        (group / limit).write_text(str(held + 100 * MB))  # the model arrives; 101 MB more cannot
        reply = read_reply(relay(node, task_content(task, w), time.time(), 120.0), w.size, None)[0]
        assert reply.refused.startswith(f"this task needs 126 MB held at once (model 25, training 76, gradient 25 MB), "
                                        f"101 MB more than this node holds now, and its memory control group {group} "
                                        "(limit less use) gives it "), reply.refused
        assert reply.refused.endswith("MB: free memory, raise the limit, or join runs of smaller models")
        (group / limit).write_text(str(held + 1536 * MB))
        reply, row, _ = read_reply(relay(node, task_content(task, w), time.time(), 120.0), w.size, None)
        assert not reply.refused and row.shape == (w.size,) and proc.poll() is None
    finally:
        if proc is not None:
            launch.stop(proc)
        for pid in (group / "cgroup.procs").read_text().split():
            (group.parent / "cgroup.procs").write_text(pid)
        group.rmdir()


# model-sized buffers a volunteer's trainer holds at its peak, by protocol, as its tasks say them
# (Protocol.memory): the model as received, the local parameters, the optimiser's state (SGD's
# momentum; AdamW's two moments), a gradient: 5 and 4
COPIES = {spec: sum(Protocol.parse(spec, lr=0.1, momentum=0.9, batch_size=1).memory(1).values()) / 4
          for spec in ("delta:steps=2,inner=adamw", "delta:steps=2")}


def _status(pid: int, key: str) -> float:
    """``VmRSS`` or ``VmHWM`` (MB) of process ``pid``."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _ready(proc, node: Path) -> None:
    until = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < until:
        try:
            channel.connect(node, time.monotonic()).close()
            return
        except channel.Absent:
            time.sleep(0.3)
    raise AssertionError(f"the trainer did not start: {(node / 'trainer.log').read_text()[-2000:]}")


def test_a_trainer_holds_each_copy_of_the_model_once(tmp_path):
    """The peak resident memory (``VmHWM``, the kernel's: PyTorch's allocations included) a fresh
    trainer adds for its first task, at two model sizes: its growth per MB of model is the number
    of model-sized buffers held at once. One more copy (of the task, a state, the row) fails."""
    sizes, added, runs = [], {spec: [] for spec in COPIES}, []
    for layers in (2, 4):
        settings = SETTINGS.replace(dataset="pystdlib:context=16", batch_size=1,
                                    model=f"gpt:layers={layers},width=512,heads=8,context=16")
        folder, nodes = make_federation(tmp_path / f"l{layers}", len(COPIES), settings)
        tasks, w = Coordinator(folder).tasks([fingerprint(node) for node in nodes])
        sizes.append(w.nbytes / MB)
        for node, spec in zip(nodes, COPIES):  # a trainer each: its first task is measured
            proc = launch.start_trainer(node, node / "trainer.log", setup={
                "device": "cpu", "dataset": "pystdlib:context=16", "root": None, "part": f"{node.name[-1]}/2",
                "attack": "", "slow": 0.0, "code": ""})
            runs.append((proc, node, spec, dataclasses.replace(tasks[fingerprint(node)], protocol=spec), w))
    try:
        for proc, node, spec, task, w in runs:
            _ready(proc, node)
            idle = _status(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the peak starts again from now
            assert not read_reply(relay(node, task_content(task, w), time.time(), 120.0), w.size, None)[0].refused
            added[spec].append(_status(proc.pid, "VmHWM") - idle)
    finally:
        for proc, *_ in runs:
            launch.stop(proc)
    slopes = {spec: (mb[1] - mb[0]) / (sizes[1] - sizes[0]) for spec, mb in added.items()}
    for spec, copies in COPIES.items():
        assert copies - 0.3 < slopes[spec] < copies + 0.5, (spec, slopes, added, sizes)


def test_the_clientapp_assembles_a_pulled_array_once_and_as_flower_does(monkeypatch, tmp_path):
    """``nodes.inflate``: a pulled array's chunks (two of them the same object) made
    into Flower's own array, its bytes joined in one allocation; the gate installs it."""
    import numpy as np
    from flwr.app import Array
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    from nodes import codetrust
    from nodes import inflate

    array = Array(np.zeros(4_000_000, dtype=np.float32))  # 16 MB: 4 chunks of at most 5 MB, the 2nd and 3rd alike
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(array).items()}
    assert len(contents) == 4  # the array and 3 distinct chunks
    flowers = inflate_object_from_contents(array.object_id, dict(contents))
    monkeypatch.setattr(Array, "inflate", classmethod(inflate.inflate))
    ours = inflate_object_from_contents(array.object_id, dict(contents))
    assert isinstance(ours.data, bytes) and ours.data == flowers.data == array.data
    assert (ours.dtype, ours.shape, ours.stype) == (flowers.dtype, flowers.shape, flowers.stype)
    assert ours.object_id == array.object_id
    assert "lean()" in (codetrust.install_gate(tmp_path) / "flwr-clientapp").read_text()  # in every task's process


def _assembled(waiting):
    """What a paused assembly (``nodes.inflate.assemble``) returns, run to its end."""
    with pytest.raises(StopIteration) as end:
        next(waiting)
    return end.value.value


def test_the_serverapp_assembles_a_reply_one_chunk_at_a_time_as_flower_does():
    """``nodes.inflate.assemble``: chunks fetched one at a time, each written where it goes
    (a chunk used twice written twice), the same array as Flower's; a chunk of another size
    or an array bigger than allowed is refused before anything that big is allocated; a chunk
    not there yet pauses the assembly, which then ends with the same array."""
    import numpy as np
    from flwr.app import Array
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    from nodes.inflate import assemble

    data = np.zeros(4_000_000, dtype=np.float32)
    data[:1000] = np.arange(1000)  # 16 MB: 4 chunks, the 2nd and 3rd alike, the last shorter
    for array in (Array(data), Array(data[:100])):  # many chunks, one chunk
        contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(array).items()}
        fetched = []
        ours = _assembled(assemble(contents[array.object_id], lambda oid: fetched.append(oid) or contents[oid], 2**25))
        flowers = inflate_object_from_contents(array.object_id, dict(contents))
        assert isinstance(ours.data, bytes) and ours.data == flowers.data == array.data
        assert (ours.dtype, ours.shape, ours.stype, ours.object_id) == (flowers.dtype, flowers.shape, flowers.stype,
                                                                         array.object_id)
        assert sorted(fetched) == sorted(set(contents) - {array.object_id})  # each distinct chunk once
    array = Array(data)
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(array).items()}
    last = array.slice_array()[-1][0]
    there = {oid: c for oid, c in contents.items() if oid != last}  # the last chunk is still on its way
    waiting = assemble(contents[array.object_id], there.get, 2**25)
    assert next(waiting) == last and next(waiting) == last  # asked again at each resumption
    there[last] = contents[last]
    assert _assembled(waiting).data == array.data
    with pytest.raises(ValueError, match="at most"):
        _assembled(assemble(contents[array.object_id], contents.__getitem__, 2**20))
    cut = Array(data)
    first, *_ = [obj for _, obj in cut.slice_array()]
    short = type(first)(first.data[:100])  # a node's own cut: a first chunk shorter than the others
    contents[cut.slice_array()[0][0]] = short.deflate()
    with pytest.raises(ValueError, match="not of one size"):
        _assembled(assemble(contents[cut.object_id], contents.__getitem__, 2**25))


def test_flowers_servers_run_with_their_reference_cycles_collected(tmp_path):
    """``nodes.collect`` runs a script as ``__main__`` with its own arguments and collects what
    only reference cycles hold (a Starlette request and its body's stream, in Flower's servers)
    even where nothing else would (here the collector is off): once at its start, then once
    its resident memory grew by 64 MB, and not before."""
    import subprocess
    import sys

    script = tmp_path / "server.py"
    script.write_text(
        "import gc, sys, time, weakref\n"
        "gc.disable()\n"
        "class Request:\n    pass\n"
        "request = Request()\nrequest.me, request.body = request, bytes(50 * 2**20)\n"
        "gone = weakref.ref(request)\ndel request\n"
        "time.sleep(8)\n"  # past the first collection, which freezes what it finds alive
        "cycle = Request()\ncycle.me, cycle.body = cycle, b'x' * (50 * 2**20)\nlater = weakref.ref(cycle)\ndel cycle\n"
        "time.sleep(1.5)\n"
        "quiet = later() is not None\n"  # 50 MB more resident: not yet
        "held = b'x' * (70 * 2**20)\n"  # 120 MB more resident than at the last collection: collected
        "time.sleep(1.5)\n"
        "print(__name__, sys.argv[1:], gone() is None, quiet, later() is None)\n")
    done = subprocess.run([sys.executable, "-m", "nodes.collect", str(script), "--port", "1"], capture_output=True,
                          text=True, check=True, timeout=60)
    assert done.stdout.split() == ["__main__", "['--port',", "'1']", "True", "True", "True"]
    assert launch._server("flower-superlink")[:3] == [sys.executable, "-m", "nodes.collect"]
