"""The examples of docs/channel.md run as written: each in a process of its own, as a reader would run them.

A block is marked in the Markdown with ``<!-- example: NAME -->`` on the line before its fence. The only change
made to it is its abstract address, made unique to the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "channel.md"


def examples() -> dict[str, str]:
    text = DOC.read_text()
    return dict(re.findall(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)```", text, re.S))


def start(code: str, address: str, unique: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code.replace(address, unique)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 120) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exited {p.returncode}:\n{out}\n{err[-4000:]}"
    return out


def test_the_examples_are_marked() -> None:
    assert set(examples()) == {"api-producer", "api-consumer", "serve-producer", "serve-consumer", "torch-producer",
                               "torch-consumer"}


def test_the_api_example_over_a_path(tmp_path: Path) -> None:
    blocks = examples()
    unique = str(tmp_path / "weights.sock")
    consumer = start(blocks["api-consumer"], "/tmp/weights.sock", unique)  # first: it waits for the producer
    producer = start(blocks["api-producer"], "/tmp/weights.sock", unique)
    assert finish(consumer).strip() == "{'step': 7} (1024, 1024) 1048576.0"
    finish(producer)  # its lease.wait returned: the consumer released the block
    assert not os.path.exists(unique)  # the listener unlinked its socket file


def test_serving_several_consumers_at_once() -> None:
    blocks = examples()
    unique = f"@weights-demo-{uuid.uuid4().hex}"
    # A consumer of another protocol version first: the producer's loop reports it and serves the others.
    stray = start("from dmabuf_interop.channel import connect\n"
                  "from dmabuf_interop.errors import PeerRefusedError\n"
                  "try:\n"
                  "    connect('@weights-demo', timeout=30, wait=True, hello_overrides={'protocol': 99})\n"
                  "except PeerRefusedError as exc:\n"
                  "    print('refused:', exc)\n", "@weights-demo", unique)
    producer = start(blocks["serve-producer"], "@weights-demo", unique)
    assert "protocol version mismatch" in finish(stray)  # (before the others connect: the loop accepts it)
    consumers = [start(blocks["serve-consumer"], "@weights-demo", unique) for _ in range(3)]
    for c in consumers:
        assert finish(c).strip() == "{'w': 32768.0, 'b': 256.0}"
    out = finish(producer)
    assert "refused consumers: 1" in out, out  # dropped, counted and logged: never raised from accept


def test_torch_tensors_in_host_memory_without_a_gpu() -> None:
    pytest.importorskip("torch", reason="the example needs torch (CI installs the CPU build)")
    blocks = examples()
    unique = f"@torch-demo-{uuid.uuid4().hex}"
    consumer = start(blocks["torch-consumer"], "@torch-demo", unique)
    producer = start(blocks["torch-producer"], "@torch-demo", unique)
    assert finish(consumer).strip() == "(128,) torch.bfloat16 64.0"
    finish(producer)
