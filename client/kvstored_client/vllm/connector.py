"""``KVStoredConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over the local kvstored daemon.

vLLM loads it by module path::

    KVTransferConfig(kv_connector="KVStoredConnector", kv_connector_module_path="kvstored_client.vllm.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"socket": "/run/kvstored/kvstored.sock"})

with ``enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor"``: blocks are keyed by
vLLM's own block hashes, which only the CBOR form makes stable across processes (refused otherwise).

Scheduler side: a new request's lookup runs on a thread of its own; until it lands,
``get_num_new_matched_tokens`` answers "not yet" (None) and the scheduler goes on with other
requests. Worker side (the copying path): before the forward pass the cached blocks are read from
the daemon's arena into vLLM's paged buffers; after it, every whole block the step computed is
stored (each chunk of a chunked prefill). Blocks that could not be loaded are reported through
``get_block_ids_with_load_errors``, so vLLM recomputes them (``kv_load_failure_policy="recompute"``).

``kv_role="kv_consumer"`` with ``peers`` (a decode engine): a new request's prompt is pulled from
the peers into the local daemon on a thread of its own, and the request waits ("not yet") while the
wait rule (``arrival.py``) says waiting for more blocks is sooner than computing them; then it
takes the prefix that is local and computes the rest, while the pull goes on for later requests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

from kvstored_client import shm
from kvstored_client.contract.errors import KVStoreError
from kvstored_client.contract.layout import TensorLayout, layout_signature
from kvstored_client.contract.namespace import Namespace
from kvstored_client.vllm.arrival import Arrival, PrefillMeter, WaitRule, decide
from kvstored_client.vllm.config import PREFILL_PRIOR, ConnectorConfig
from kvstored_client.vllm.link import DaemonLink
from kvstored_client.vllm.plan import LoadSpec, SavePlanner, SaveSpec, blocks_spanned, external_tokens, loadable_blocks

log = logging.getLogger(__name__)

HASH_ALGO = "sha256_cbor"
# A pull's own deadline: the daemon ends each peer transfer by its peers.deadline_s; this only
# bounds a daemon that never answers, on the pull's thread, never the scheduler's.
PULL_TIMEOUT_S = 300.0
# Between two looks at how much of a waiting prompt has arrived: a lookup each, on the lookup thread.
POLL_S = 0.01
# Prompts pulled at once (a thread and a daemon client each); more wait for one of them.
PULLS = 4


@dataclass
class KVStoredMetadata(KVConnectorMetadata):
    """One step's work for the worker side: loads before the forward pass, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def namespace_of(vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> Namespace:
    """The namespace both sides use: the model, vLLM's KV dtype and block size, the page layout
    (platform, layers, bytes per block per layer), the TP shard and vLLM's hash seed. Refuses
    (ValueError) what the connector cannot serve: pickle-based block hashes, prefix caching off,
    more than one KV cache group."""
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        raise ValueError("KVStoredConnector needs enable_prefix_caching=True (it keys blocks by vLLM's block hashes)")
    if cache.prefix_caching_hash_algo != HASH_ALGO:
        raise ValueError(f"KVStoredConnector needs prefix_caching_hash_algo={HASH_ALGO!r}: vLLM's "
                         f"{cache.prefix_caching_hash_algo!r} hashes are not stable across processes, "
                         "so no other engine could ever find the blocks")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KVStoredConnector serves models with one KV cache group, this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    # A block's payload: each layer's bytes of the block, layer after layer, as the SDK lays out
    # buffers registered one row of bytes per block: the copying path's rows are the same bytes.
    row = TensorLayout((1, spec.page_size_bytes), (spec.page_size_bytes, 1), "int8", 0)
    layout = layout_signature([row] * len(groups[0].layer_names))
    # the bytes' order within a layer's block is the attention backend's: the platform and spec say which
    kv_dtype = f"{model.dtype}/{cache.cache_dtype} vllm-{current_platform.device_type} {type(spec).__name__}"
    return Namespace(model=config.model or str(model.model), revision=str(model.revision or ""),
                     kv_dtype=kv_dtype, block_size=spec.block_size, layout=layout,
                     tp_rank=parallel.rank % max(parallel.tensor_parallel_size, 1),
                     tp_size=parallel.tensor_parallel_size, hash_algo=HASH_ALGO,
                     hash_seed=none_hash_seed(),
                     # known before the worker registers its buffers: a pull into this node needs it
                     block_bytes=spec.page_size_bytes * len(groups[0].layer_names))


def none_hash_seed() -> str:
    """The seed of vLLM's first block's parent hash, as vLLM resolves it for a cryptographic hash:
    ``PYTHONHASHSEED`` if set, else a fixed default. Resolved here rather than asked of vLLM, whose
    answer depends on whether this process has hashed anything yet (the scheduler's and the
    worker's namespaces must be equal)."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


class _SharedKVAllocation(TorchFunctionMode):  # type: ignore[misc]
    """While vLLM allocates its KV cache (``get_mem_pool_context``): the one zero-filled int8 CPU
    buffer it asks for comes from a shared-memory file the daemon can map. Anything else, or a
    buffer the shared-memory directory has no room for (logged), is allocated as usual."""

    def __init__(self, keep: Callable[[shm.SharedTensor], None]) -> None:
        super().__init__()
        self._keep = keep

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and len(args) == 1 and isinstance(args[0], int) and kwargs.get("dtype") is torch.int8 \
                and torch.device(kwargs.get("device", "cpu")).type == "cpu" and set(kwargs) <= {"dtype", "device"}:
            try:
                shared = shm.empty((args[0],), "int8")
            except (OSError, ValueError) as exc:
                log.warning("kvstored: vLLM's KV cache stays private (%s); blocks are copied by the engine", exc)
            else:
                self._keep(shared)
                return shared.torch()
        return func(*args, **kwargs)


class KVStoredConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's external prefix cache in kvstored: zero copy where vLLM's KV cache could be
    allocated in shared memory (the daemon copies blocks in and out of it), else blocks are
    copied between vLLM's paged buffers and the daemon's arena by the engine."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config,
                                                 str(transfer.kv_role or "kv_both"))
        self.namespace = namespace_of(vllm_config, kv_cache_config, self.config)
        self.block_size = self.namespace.block_size
        self._num_blocks = int(kv_cache_config.num_blocks)
        # a consumer's scheduler side pulls from the peers, so its loads take what is local
        self._link = DaemonLink(self.config.socket, self.namespace, self.config.timeout_s,
                                f"vllm-{'scheduler' if role == KVConnectorRole.SCHEDULER else 'worker'}",
                                self.config.peers and not self.config.waits_for_arrivals)
        # scheduler side
        self._lookup_thread = ThreadPoolExecutor(1, thread_name_prefix="kvstored-lookup")
        self._lookups: dict[str, Future[int]] = {}
        self._asked: dict[str, int] = {}          # req_id -> num_computed it was asked with
        self._requests: dict[str, Any] = {}       # req_id -> vLLM Request (its block hashes grow)
        self._loads: list[LoadSpec] = []
        self._planner = SavePlanner(self.block_size)
        # scheduler side of a consumer: prompts arriving from peers, and the looks at them in flight
        self._meter = PrefillMeter(PREFILL_PRIOR, self.block_size)
        self._clock = time.monotonic
        self._arrivals: dict[str, Arrival] = {}
        self._looks: dict[str, Future[tuple[float, int, int]]] = {}
        self._pulls: ThreadPoolExecutor | None = None
        self._pull_links: list[DaemonLink] = []     # one per pull thread (a link is not thread-safe)
        self._pull_local = threading.local()
        if self.config.waits_for_arrivals and role == KVConnectorRole.SCHEDULER:
            self._pulls = ThreadPoolExecutor(PULLS, thread_name_prefix="kvstored-pull")
        # worker side
        self._layers: list[torch.Tensor] = []     # per layer: a view with the block dimension first
        self._widths: list[int] = []              # per layer: bytes of one block
        self._load_errors: set[int] = set()
        self._shared: shm.SharedTensor | None = None
        self._layer_index: dict[str, int] = {}
        self._loading: list[tuple[LoadSpec, Any]] = []   # zero-copy loads in flight, with their handles
        log.info("kvstored connector: namespace %s, %s, load=%s save=%s", self.namespace, self.config.role,
                 self.config.load, self.config.save)

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.load:
            return 0, False
        whole = request.num_tokens // self.block_size
        hashes = list(request.block_hashes[:whole])
        if min(len(hashes) * self.block_size, request.num_tokens - 1) <= num_computed_tokens:
            return 0, False
        if self.config.waits_for_arrivals:
            hit = self._arrived(request.request_id, hashes, request.num_tokens)
            if hit is None:
                return None, False
        else:
            lookup = self._lookups.get(request.request_id)
            if lookup is None:
                # never block the scheduler on a round trip: ask, and say "not yet" until it lands
                self._lookups[request.request_id] = self._lookup_thread.submit(self._link.lookup, hashes)
                return None, False
            if not lookup.done():
                return None, False
            hit = lookup.result()
        self._asked[request.request_id] = num_computed_tokens
        return external_tokens(hit, request.num_tokens, num_computed_tokens, self.block_size), False

    def _arrived(self, req_id: str, hashes: list[bytes], num_tokens: int) -> int | None:
        """A consumer's request: the local blocks to start on, or None while it waits for more.
        First a lookup that counts the peers' blocks; if they hold more, a pull of the prompt
        starts, and each later call looks at how much is local until the wait rule says go."""
        look = self._looks.get(req_id)
        if look is None:
            look = self._looks[req_id] = self._lookup_thread.submit(self._look, hashes, True)
        if not look.done():
            return None
        observed, local, total = look.result()
        arrival = self._arrivals.get(req_id)
        if arrival is None:
            arrival = Arrival(observed, local, loadable_blocks(total, num_tokens, self.block_size), observed, local)
            if arrival.target > local and self._pulls is not None:
                # runs to its end even if the request starts first: later requests find the blocks
                self._pulls.submit(self._pull, hashes)
        else:
            arrival = arrival.seen(observed, local)
        self._arrivals[req_id] = arrival
        now = self._clock()
        rate = self.config.prefill_tokens_per_s or self._meter.tokens_per_s
        verdict = decide(WaitRule(rate, self.block_size, self.config.max_wait_s), arrival, now)
        if verdict.waits:
            if now - observed >= POLL_S:
                self._looks[req_id] = self._lookup_thread.submit(self._look, hashes, False)
            else:
                self._looks[req_id] = self._lookup_thread.submit(self._look_later, hashes, observed + POLL_S)
            return None
        log.debug("kvstored: request %s starts on %d of %d blocks after %.3f s (%s; prefill at %.0f tokens/s)",
                  req_id, arrival.local, arrival.target, now - arrival.started, verdict.value, rate)
        return arrival.local

    def _look(self, hashes: list[bytes], peers: bool) -> tuple[float, int, int]:
        """When, the chain's leading blocks on this node, and with what peers hold (on the lookup thread)."""
        local, total = self._link.lookup_split(hashes, peers) if peers else (self._link.lookup(hashes, False), 0)
        return self._clock(), local, total

    def _pull(self, hashes: list[bytes]) -> int:
        """Bring the chain from the peers into the local daemon (on a pull thread)."""
        link = getattr(self._pull_local, "link", None)
        if link is None:
            link = self._pull_local.link = DaemonLink(self.config.socket, self.namespace, PULL_TIMEOUT_S,
                                                      "vllm-pull", True)
            self._pull_links.append(link)
        return link.pull(hashes)

    def _look_later(self, hashes: list[bytes], at: float) -> tuple[float, int, int]:
        time.sleep(max(0.0, at - self._clock()))
        return self._look(hashes, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._lookups.pop(req_id, None)
        self._looks.pop(req_id, None)
        self._arrivals.pop(req_id, None)
        computed = self._asked.pop(req_id, 0)
        if num_external_tokens <= 0:
            return
        first = computed // self.block_size
        # a prompt of whole blocks claims all but its last token: its last block is loaded whole,
        # and vLLM writes that token's KV over the loaded copy when it computes it
        last = blocks_spanned(computed + num_external_tokens, self.block_size)
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(LoadSpec(req_id, tuple(request.block_hashes[:last]), tuple(block_ids[first:last]), first))

    def build_connector_meta(self, scheduler_output: Any) -> KVStoredMetadata:
        if self.config.waits_for_arrivals:
            self._meter.step_scheduled(self._clock(), sum(scheduler_output.num_scheduled_tokens.values()))
        meta = KVStoredMetadata(loads=self._loads)
        loaded = {spec.req_id: len(spec.hashes) for spec in self._loads}
        self._loads = []
        if not self.config.save:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._planner.started(new.req_id, new.block_ids[0], loaded.get(new.req_id, 0))
            self._add_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                self._planner.started(req_id, new_ids[0], 0)   # after preemption: all its blocks anew
            elif new_ids is not None:
                self._planner.grew(req_id, new_ids[0])
            self._add_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _add_save(self, meta: KVStoredMetadata, req_id: str, computed_tokens: int) -> None:
        request = self._requests.get(req_id)
        if request is None:
            return
        spec = self._planner.due(req_id, computed_tokens, request.block_hashes)
        if spec is not None:
            meta.saves.append(spec)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if self._requests.pop(req_id, None) is not None:
            self._meter.step_ended(self._clock())   # it ran: the step that finished it is over
        self._asked.pop(req_id, None)
        for pending in (self._lookups.pop(req_id, None), self._looks.pop(req_id, None)):
            if pending is not None:
                pending.cancel()
        self._arrivals.pop(req_id, None)
        self._planner.finished(req_id)
        return False, None

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember each layer's paged tensor with its block dimension first (vLLM's CPU layout
        has it first already; its GPU layout puts K/V before it)."""
        self._layers, self._widths = [], []
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        for name, tensor in kv_caches.items():
            dim = 0 if tensor.shape[0] == self._num_blocks else 1
            if tensor.shape[dim] != self._num_blocks:
                raise ValueError(f"KVStoredConnector: layer {name} has shape {tuple(tensor.shape)}, no dimension "
                                 f"of {self._num_blocks} blocks")
            view = tensor.movedim(dim, 0)
            self._layers.append(view)
            self._widths.append(view[0].numel() * view.element_size())
        row = self.namespace.layout.split("+")
        if len(row) != len(self._widths) or any(r != f"int8[{w}]" for r, w in zip(row, self._widths)):
            raise ValueError(f"KVStoredConnector: vLLM's layers hold blocks of {self._widths} bytes; expected {row}")
        if self._shared is not None:
            start, end = self._shared.base_address, self._shared.base_address + self._shared.nbytes
            rows = [layer.reshape(self._num_blocks, -1).view(torch.int8) for layer in self._layers]
            if all(start <= r.data_ptr() < end and r.data_ptr() + r.numel() <= end for r in rows):
                self._link.share(rows)
            else:
                log.warning("kvstored: vLLM's KV tensors are not in the shared buffer; blocks are copied by the engine")
        log.info("kvstored connector: the %s path", self.path)

    @property
    def path(self) -> str:
        """How blocks move on this worker: "zero-copy" (the daemon copies into vLLM's shared
        KV cache) or "copying" (the engine copies through the daemon's arena)."""
        return "zero-copy" if self._link.shares else "copying"

    def get_mem_pool_context(self) -> Any:
        if not self.config.zero_copy or self.role != KVConnectorRole.WORKER:
            return None
        return _SharedKVAllocation(self._keep_shared)

    def _keep_shared(self, shared: shm.SharedTensor) -> None:
        self._shared = shared

    def _gather(self, block_ids: tuple[int, ...]) -> np.ndarray:
        """One row per block: its bytes of every layer, layer after layer."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self._layers[0].device)
        parts = [layer.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for layer in self._layers]
        return torch.cat(parts, dim=1).cpu().numpy()

    def _scatter(self, rows: np.ndarray, block_ids: tuple[int, ...]) -> None:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self._layers[0].device)
        data = torch.from_numpy(np.ascontiguousarray(rows)).to(self._layers[0].device)
        offset = 0
        for layer, width in zip(self._layers, self._widths):
            part = data[:, offset:offset + width].contiguous().view(layer.dtype)
            layer.index_copy_(0, index, part.reshape(len(block_ids), *layer.shape[1:]))
            offset += width

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for spec in meta.loads:
            if self._link.shares and spec.first == 0:
                # zero copy: the daemon copies into vLLM's blocks. (A load after a local hit takes
                # the copying path: the local blocks, maybe in use by running requests, are not
                # written again.)
                handle = self._link.load_blocks(spec.block_ids, spec.hashes)
                if handle is None:
                    self._load_errors.update(spec.block_ids)
                else:
                    self._loading.append((spec, handle))
                continue
            # the rows of the blocks vLLM lacks only: those before spec.first it has already
            loaded = self._link.load(spec.hashes, start=spec.first)
            got = 0 if loaded is None else min(loaded[0], len(spec.hashes))
            if loaded is not None and got > spec.first and loaded[1].shape[1] != sum(self._widths):
                log.warning("kvstored: blocks of %d bytes, vLLM's are %d; not loading", loaded[1].shape[1],
                            sum(self._widths))
                got = 0
            if loaded is not None and got > spec.first:
                self._scatter(loaded[1][:got - spec.first], spec.block_ids[:got - spec.first])
            # what the lookup promised but the load did not bring (evicted since, or the daemon
            # gone): vLLM recomputes these blocks
            self._load_errors.update(spec.block_ids[max(got - spec.first, 0):])
        if not self.config.layerwise:
            self._finish_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Zero copy, layer-wise: wait until this layer of every load is in place (the copying
        path loaded every layer before the forward pass)."""
        index = self._layer_index.get(layer_name)
        if index is None:   # a layer vLLM did not register: wait for every layer
            self._finish_loads()
            return
        for spec, handle in self._loading:
            try:
                handle.wait_layer(index)
            except KVStoreError as exc:
                # the layer computes on what arrived; the step's result for this request is
                # thrown away and recomputed, as its blocks are reported as failed
                self._link.failed("load_blocks", exc)
                self._load_errors.update(spec.block_ids)

    def _finish_loads(self) -> None:
        """Wait for the zero-copy loads; blocks they did not bring are reported as failed."""
        loading, self._loading = self._loading, []
        for spec, handle in loading:
            try:
                loaded = handle.wait().blocks
            except KVStoreError as exc:
                self._link.failed("load_blocks", exc)
                loaded = 0
            self._load_errors.update(spec.block_ids[loaded:])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return   # stored after the forward pass, all layers of a block in one row

    def wait_for_save(self) -> None:
        self._finish_loads()   # before vLLM asks for the step's load errors
        meta = self._get_connector_metadata()
        for spec in meta.saves:
            if self._link.shares:
                self._link.save_blocks(spec.block_ids, spec.hashes, self.config.push_to)
            else:
                # the rows of the newly computed blocks only; if the daemon lost the earlier ones
                # meanwhile it stores none (a miss later, never a chain with a hole)
                self._link.save(spec.hashes, self._gather(spec.block_ids[spec.first:]), self.config.push_to,
                                start=spec.first)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._lookup_thread.shutdown(wait=False, cancel_futures=True)
        self._link.close()
        if self._pulls is not None:
            self._pulls.shutdown(wait=False, cancel_futures=True)
            for link in self._pull_links:
                link.close()
        # the shared KV buffer goes when vLLM's tensors do (they keep it alive)
