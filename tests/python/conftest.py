import os
import socket

import pytest
import torch.distributed as dist

import meshla.torch as mt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_env(monkeypatch):
    """Environment for torch.distributed's env:// rendezvous on loopback."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return dict(os.environ)


@pytest.fixture
def world1(gloo_env):
    """A one-rank CPU TPGroup over a gloo process group."""
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield mt.group_from_process_group(device="cpu")
    dist.destroy_process_group()
