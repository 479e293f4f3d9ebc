"""CUDA IPC path (run by tools/gpu-check on a CUDA host; skipped elsewhere, with the reason).

Two processes: the engine (this test process, torch tensors on the GPU) and the daemon (a
subprocess that opens the IPC handles with cupy and copies on its own stream).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys

import pytest

# tools/gpu-check sets this: there a missing piece is a failure, not a skip that looks like a pass
if os.environ.get("KVSTORED_REQUIRE_GPU") == "1":
    for _module in ("torch", "cupy"):
        if importlib.util.find_spec(_module) is None:
            pytest.fail(f"KVSTORED_REQUIRE_GPU=1 but {_module} is not installed", pytrace=False)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    if os.environ.get("KVSTORED_REQUIRE_GPU") == "1":
        pytest.fail("KVSTORED_REQUIRE_GPU=1 but torch sees no CUDA device", pytrace=False)
    pytest.skip("no CUDA device on this host (CPU twin covers the same code above the copy)",
                allow_module_level=True)
pytest.importorskip("cupy", reason="the daemon's CUDA path needs cupy (extra 'cuda')")

import kvstored  # noqa: E402
from conftest import ROOT  # noqa: E402

SHAPE = (2, 64, 16, 8, 128)  # vLLM flash layout per layer, bf16: 64 KiB per block per layer


def _engine(client: kvstored.Client, layers: int = 4, model: str = "gpu-test") -> tuple[list, kvstored.Buffers]:
    kv = [torch.randn(SHAPE, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    torch.cuda.synchronize()   # the daemon copies on its own stream: the engine's writes must be done
    buffers = client.register_buffers(kv, block_dim=1, namespace=kvstored.Namespace(model=model))
    return kv, buffers


def test_save_and_load_between_engines(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as a, kvstored.Client(daemon.socket) as b:
        src, bs = _engine(a)
        dst = [torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        bd = b.register_buffers(dst, block_dim=1, namespace=kvstored.Namespace(model="gpu-test"))
        tokens = list(range(16 * 8))
        assert a.save_blocks(bs, list(range(10, 18)), tokens).stored == 8
        assert b.load_blocks(bd, list(range(8)), tokens).blocks == 8
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            assert torch.equal(s[:, 10:18], d[:, :8])
        handle = b.load_blocks(bd, list(range(20, 28)), tokens, wait=False)
        for i in range(4):
            handle.wait_layer(i, timeout=60)
        assert handle.wait(timeout=60).blocks == 8


def test_unregister_waits_for_copies_then_engine_may_free(daemon) -> None:  # type: ignore[no-untyped-def]
    with kvstored.Client(daemon.socket) as c:
        kv, buffers = _engine(c, layers=8)
        tokens = list(range(16 * 64))
        c.save_blocks(buffers, list(range(64)), tokens)
        handle = c.load_blocks(buffers, list(range(64)), tokens, wait=False)
        c.unregister_buffers(buffers)  # returns only once the daemon has drained and closed handles
        assert handle.wait(timeout=60).blocks == 64
        del kv
        torch.cuda.empty_cache()
        assert daemon.proc.poll() is None


def test_engine_crash_closes_its_handles(daemon) -> None:  # type: ignore[no-untyped-def]
    code = f"""
import torch, kvstored, time
c = kvstored.Client({daemon.socket!r})
kv = [torch.ones({SHAPE}, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
b = c.register_buffers(kv, block_dim=1, namespace=kvstored.Namespace(model="crash"))
c.save_blocks(b, list(range(4)), list(range(64)))
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    with kvstored.Client(daemon.socket) as c:
        assert c.lookup(list(range(64)), namespace=kvstored.Namespace(
            model="crash", layout="bfloat16[2, 16, 8, 128]")).blocks == 4  # the saved blocks survive
        assert c.stats()["clients"] == 1
    assert daemon.proc.poll() is None


def test_wrong_device_is_refused(daemon) -> None:  # type: ignore[no-untyped-def]
    from kvstored_client.contract.proto import kvstored_pb2 as pb

    with kvstored.Client(daemon.socket) as c:
        kv = torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16)
        from kvstored_client.cuda_export import export

        dev = export(kv)
        ns_id = c._ns(kvstored.Namespace(model="wrong-device", layout="bfloat16[2, 16, 8, 128]"))[0]
        desc = pb.TensorDesc(offset=dev.offset, cuda_ipc_handle=dev.handle, device_uuid="GPU-00000000-dead-beef",
                             shape=SHAPE, strides=kv.stride(), dtype="bfloat16", block_dim=1)
        with pytest.raises(Exception, match="no device with UUID"):
            c._call(c._stub.RegisterBuffers, pb.RegisterBuffersRequest(
                session_id=c._session(), namespace_id=ns_id, tensors=[desc]))


def test_cupy_arrays_carved_from_one_pool_allocation_round_trip(daemon) -> None:  # type: ignore[no-untyped-def]
    """cupy's memory pool splits one CUDA allocation between arrays: each must be registered at
    its offset in that allocation (the IPC handle opens the whole of it), and the daemon must map
    the allocation once for all of them."""
    import cupy

    big = cupy.empty(256 << 20, dtype=cupy.uint8)
    del big   # back to the pool: the arrays below are carved out of this one allocation
    src = [cupy.random.random(SHAPE, dtype=cupy.float32).astype(cupy.float16) for _ in range(2)]
    dst = [cupy.zeros(SHAPE, dtype=cupy.float16) for _ in range(2)]
    cupy.cuda.Device().synchronize()
    with kvstored.Client(daemon.socket) as c:
        ns = kvstored.Namespace(model="gpu-cupy")
        bs = c.register_buffers(src, block_dim=1, namespace=ns)
        bd = c.register_buffers(dst, block_dim=1, namespace=ns)
        tokens = list(range(16 * 4))
        assert c.save_blocks(bs, [3, 4, 5, 6], tokens).stored == 4
        assert c.load_blocks(bd, [0, 1, 2, 3], tokens).blocks == 4
        cupy.cuda.Device().synchronize()
        for s, d in zip(src, dst):
            assert bool(cupy.array_equal(s[:, 3:7], d[:, 0:4]))
