"""The catalog: namespaces, each with its prefix index, and the chains of keys clients name."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvstored.config import Config
from kvstored.index import Block, Observer, PrefixIndex
from kvstored.store.values import KeyRequest
from kvstored.tiers.dram import slot_size
from kvstored.tiers.ssd import SSDTier
from kvstored_client.contract.errors import InvalidArgument, KVStoreError, NotFound, Reason
from kvstored_client.contract.hashing import block_hashes
from kvstored_client.contract.namespace import Namespace

log = logging.getLogger("kvstored.store")


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: int
    spec: Namespace
    index: PrefixIndex
    on_ssd: bool = False   # its record is written (or on its way) to the SSD tier


class Catalog:
    """Namespaces by id. A namespace's block size in bytes is fixed once known, and its record
    goes to the SSD tier (when there is one) so that a restart can take its blocks back."""

    def __init__(self, config: Config, ssd: SSDTier | None) -> None:
        self._config = config
        self._ssd = ssd
        self._namespaces: dict[int, NamespaceState] = {}
        self.observer: Observer | None = None   # given to each new namespace's index

    def __len__(self) -> int:
        return len(self._namespaces)

    def __iter__(self) -> Iterator[NamespaceState]:
        return iter(list(self._namespaces.values()))

    def blocks(self) -> Iterator[Block]:
        """Every block of every namespace (a snapshot per namespace)."""
        for state in list(self._namespaces.values()):
            yield from state.index

    def block_count(self) -> int:
        return sum(len(s.index) for s in self._namespaces.values())

    def open(self, spec: Namespace) -> NamespaceState:
        """Create or find the namespace of ``spec``; its block size in bytes is fixed once known."""
        why = self.refusal_of(spec)
        if why:
            raise InvalidArgument(why)
        namespace_id = spec.identity()
        state = self._namespaces.get(namespace_id)
        if state is None:
            state = self.add(namespace_id, spec)
        elif spec.block_bytes:
            self.fix_block_bytes(state, spec.block_bytes)
        return state

    def refusal_of(self, spec: Namespace) -> str:
        """Why this daemon cannot hold ``spec``'s blocks as configured ("" when it can): opened
        by a client, or found on SSD at restart (the config may have changed since)."""
        try:
            spec.validate()
        except (TypeError, ValueError) as exc:
            return str(exc)
        if spec.hash_algo != "sha256_cbor" and not self._config.keys.allow_fast_hash:
            return (f"namespace.hash_algo {spec.hash_algo!r} is disabled on this daemon "
                    "(set keys.allow_fast_hash = true on trusted single-tenant nodes)")
        return self._too_large(spec.block_bytes)

    def add(self, namespace_id: int, spec: Namespace) -> NamespaceState:
        """A new namespace (``spec`` accepted by :meth:`refusal_of`)."""
        assert namespace_id not in self._namespaces, f"namespace {namespace_id} added twice"
        state = NamespaceState(namespace_id, spec, PrefixIndex(namespace_id, self.observer))
        self._namespaces[namespace_id] = state
        if spec.block_bytes:
            state.index.block_bytes = spec.block_bytes
            state.index.slot_bytes = slot_size(spec.block_bytes)
            self.persist(state)
        return state

    def persist(self, state: NamespaceState) -> None:
        """Write the namespace's record to the SSD tier (restore needs it to take its blocks
        back); if the write fails, ``on_ssd`` turns False and the next write-back of one of its
        blocks writes the record again first."""
        if self._ssd is None:
            return
        state.on_ssd = True

        def written(fut: Future[None]) -> None:   # on the writer thread: one flag, read on the loop
            if fut.exception() is not None:
                state.on_ssd = False

        self._ssd.put_namespace(state.namespace_id,
                                json.dumps(dataclasses.asdict(state.spec)).encode()).add_done_callback(written)

    def _too_large(self, block_bytes: int) -> str:
        """Why blocks of ``block_bytes`` cannot have a DRAM slot here ("" when they can)."""
        if block_bytes > self._config.dram.page_bytes:
            return (f"block_bytes {block_bytes} exceeds dram.page_bytes {self._config.dram.page_bytes}; "
                    "raise it in the daemon config")
        return ""

    def fix_block_bytes(self, state: NamespaceState, block_bytes: int) -> None:
        """Fix the namespace's block size on first use; InvalidArgument for any other size."""
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes must be positive")
        if why := self._too_large(block_bytes):
            raise InvalidArgument(why)
        if state.spec.block_bytes == 0:
            state.spec = dataclasses.replace(state.spec, block_bytes=block_bytes)
            state.index.block_bytes = block_bytes
            state.index.slot_bytes = slot_size(block_bytes)
            self.persist(state)
        elif state.spec.block_bytes != block_bytes:
            raise InvalidArgument(f"namespace {state.spec.model!r} stores blocks of "
                                  f"{state.spec.block_bytes} bytes; got {block_bytes}")

    def get(self, namespace_id: int) -> NamespaceState:
        """The namespace; NotFound for one never opened."""
        state = self._namespaces.get(namespace_id)
        if state is None:
            raise NotFound(f"unknown namespace {namespace_id}: open it first", Reason.UNKNOWN_NAMESPACE)
        return state

    def find(self, namespace_id: int) -> NamespaceState | None:
        return self._namespaces.get(namespace_id)

    def resolve_keys(self, namespace_id: int, keys: KeyRequest) -> tuple[NamespaceState, list[bytes]]:
        """The namespace and the chain of block keys named by ``keys`` (validated, within limits)."""
        state = self.get(namespace_id)
        spec = state.spec
        limit = self._config.server.max_batch_blocks
        if sum(map(bool, (keys.hashes, keys.packed_hashes, keys.token_ids))) > 1:
            raise InvalidArgument("give one of hashes, packed_hashes or token_ids (not several)", Reason.BAD_KEYS)
        if keys.hashes or keys.packed_hashes:
            if keys.cache_salt or keys.lora_name:
                raise InvalidArgument("cache_salt and lora_name apply to token ids only; "
                                      "engine hashes already include them", Reason.BAD_KEYS)
            size = spec.digest_size
            if keys.packed_hashes and len(keys.packed_hashes) % size:
                raise InvalidArgument(f"packed_hashes has {len(keys.packed_hashes)} bytes, not a whole number "
                                      f"of {size}-byte {spec.hash_algo} keys", Reason.BAD_KEYS)
            n = len(keys.packed_hashes) // size or len(keys.hashes)
            if n > limit:
                raise InvalidArgument(f"{n} blocks exceed server.max_batch_blocks={limit}", Reason.TOO_MANY_BLOCKS)
            if keys.packed_hashes:   # numpy cuts them apart in C, each a bytes object of its own
                return state, np.frombuffer(keys.packed_hashes, f"V{size}").tolist()
            chain = list(keys.hashes)
            if set(map(len, chain)) != {size}:  # the common case costs one C-level pass
                for i, h in enumerate(chain):
                    if len(h) != size:
                        raise InvalidArgument(f"hashes[{i}] has {len(h)} bytes; {spec.hash_algo} keys have "
                                              f"{size}", Reason.BAD_KEYS)
            return state, chain
        if len(keys.token_ids) // spec.block_size > limit:
            raise InvalidArgument(f"{len(keys.token_ids) // spec.block_size} blocks exceed "
                                  f"server.max_batch_blocks={limit}", Reason.TOO_MANY_BLOCKS)
        try:
            chain = block_hashes(keys.token_ids, spec.block_size, spec.hash_seed, spec.hash_algo,
                                 cache_salt=keys.cache_salt or None, lora_name=keys.lora_name or None)
        except ValueError as exc:
            raise InvalidArgument(str(exc), Reason.BAD_KEYS) from None
        return state, chain

    def ids_of(self, model: str) -> set[int]:
        """The namespaces of ``model`` (all when empty); NotFound for a model this node has never
        seen, so a mistyped name is an error rather than a silent no-op."""
        ids = {ns_id for ns_id, s in self._namespaces.items() if not model or s.spec.model == model}
        if model and not ids:
            known = sorted({s.spec.model for s in self._namespaces.values()})
            raise NotFound(f"no namespace of model {model!r} on this node (models here: "
                           f"{', '.join(map(repr, known)) or 'none'})", Reason.UNKNOWN_MODEL)
        return ids

    def describe(self, namespace_id: int) -> bytes:
        """The namespace's spec as a peer learns it (JSON); NotFound for an unknown one."""
        return json.dumps(dataclasses.asdict(self.get(namespace_id).spec), sort_keys=True).encode()

    def learn(self, namespace_id: int, description: bytes) -> str:
        """Open the namespace a peer described (:meth:`describe`); "" or why not."""
        try:
            spec = Namespace(**json.loads(description))
            spec.validate()   # here, where a field of the wrong type (a TypeError) is the peer's fault
        except (TypeError, ValueError) as exc:
            return f"not a namespace description: {exc}"
        if spec.identity() != namespace_id:
            return f"namespace id {namespace_id} does not match its description"
        try:
            self.open(spec)
        except KVStoreError as exc:
            return str(exc)
        return ""

    def restore_records(self) -> None:
        """Take back the namespaces whose records the SSD tier holds (at start, before its
        blocks); those this config refuses are left out, and their blocks with them."""
        if self._ssd is None:
            return
        for namespace_id, raw in self._ssd.namespaces().items():
            try:
                spec = Namespace(**json.loads(raw))
            except (TypeError, ValueError):
                continue
            why = self.refusal_of(spec)
            if why:
                # the config changed since (dram.page_bytes lowered, keys.allow_fast_hash turned
                # off): a client could not open it now, so its blocks go as those of a namespace
                # restore does not know
                log.warning("not restoring namespace of model %r: %s", spec.model, why)
                continue
            if spec.identity() == namespace_id and namespace_id not in self._namespaces:
                self.add(namespace_id, spec)
