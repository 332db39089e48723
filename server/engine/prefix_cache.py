"""Prefix caching: a request reuses the KV blocks of a prompt prefix that another one computed.

A full block is identified by a chained hash, sha256(parent block's hash + the block's token ids),
so two blocks match only when everything before them matches too. A request's `cache_salt` (vLLM's
field) and its LoRA adapter are the parent of its first block: only requests with the same salt
and the same adapter (the same load of it) share blocks. A strong
hash makes a collision (which would silently serve wrong keys/values) practically impossible,
without keeping the tokens.
The hashes of a row's blocks are kept on its `Sequence` (forks copy them), each computed once.

The pool keeps the hash -> block map and the evictable blocks (block_pool.py); this module decides
which blocks are tagged (`register`, after the step that filled them) and which a new row takes
over (`attach`, when the scheduler admits a row that has nothing computed).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Tokens

from server.engine.block_pool import BlockPool
from server.engine.request import Sequence

ROOT_HASH = b""  # parent of a sequence's first block (unsalted)


def root_hash(
    cache_salt: str | None,
    adapter_key: str | None = None,
    source: Tokens[int] = (),
    exact: bool = False,
    companion: str | None = None,
    model: str | None = None,
) -> bytes:
    """The parent of a sequence's first block: ROOT_HASH (no salt, the base model), or the
    hash of its request's salt, adapter, source and precision. An encoder-decoder row's first
    blocks are its source's cross-attention keys and values, and the encoder reads the source
    both ways: a block is the same only under the same whole source, not the same leading
    tokens. A prompt that scores runs at full precision under an int8 format: its blocks are
    not another request's. A fused request's blocks hold its `companion` model's keys and values
    too (engine/fusion.py): they are shared only with requests fused with the same companion. A
    request that names an extra `model` has that model's keys and values in its blocks alone."""
    named = (cache_salt, adapter_key, companion, model)
    if all(n is None for n in named) and not source and not exact:
        return ROOT_HASH
    parts = b"\x00exact" if exact else b""
    if cache_salt is not None:
        parts += b"cache_salt:" + cache_salt.encode()
    if adapter_key is not None:  # a length prefix: no salt can imitate an adapter
        parts += b"\x00lora:%d:" % len(adapter_key) + adapter_key.encode()
    if source:
        parts += b"\x00source:%d:" % len(source) + array("q", source).tobytes()
    if companion is not None:
        parts += b"\x00lm_fusion:%d:" % len(companion) + companion.encode()
    if model is not None:
        parts += b"\x00model:%d:" % len(model) + model.encode()
    return hashlib.sha256(parts).digest()


def hash_block(parent: bytes, tokens: Tokens[int]) -> bytes:
    """Identity of a full block: its token ids and, through `parent`, every token before them."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Hash of full block `index` of `seq`, computing (and keeping) those not yet known."""
        hashes = seq.block_hashes
        bs = self.pool.block_size
        while len(hashes) <= index:
            i = len(hashes)
            req = seq.request
            parent = (
                hashes[-1]
                if hashes
                else root_hash(
                    req.cache_salt,
                    req.adapter_key,
                    req.prompt_ids[: req.source_len] if req.source_len else (),
                    req.scores_prompt,
                    req.companion,
                    req.model,
                )
            )
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[index]

    def attach(self, seq: Sequence, limit: int | None = None) -> int:
        """Give a row with nothing computed the longest run of cached blocks matching its leading
        tokens, within its first `limit` tokens; returns the tokens it now has computed. The last
        token is always left to compute: the row needs its logits to sample."""
        assert seq.num_computed == 0 and not seq.block_table
        table = seq.block_table
        usable = len(seq.token_ids) - 1 if limit is None else min(limit, len(seq.token_ids) - 1)
        for index in range(usable // self.pool.block_size):
            block = self.pool.cached_block(self.block_hash(seq, index))
            if block is None:
                break
            self.pool.acquire(block)
            table.append(block)
        seq.num_computed = len(table) * self.pool.block_size
        return seq.num_computed

    def detach(self, seq: Sequence) -> None:
        """Undo `attach` (the row was not admitted after all): it owns nothing, computed nothing."""
        self.pool.release(seq.block_table)
        seq.num_computed = 0

    def register(self, seq: Sequence, computed_before: int) -> None:
        """Tag the blocks a step has just filled (computed tokens went from `computed_before` to
        `seq.num_computed`), so later requests can find them."""
        bs = self.pool.block_size
        for index in range(computed_before // bs, seq.num_computed // bs):
            self.pool.tag(seq.block_table[index], self.block_hash(seq, index))
