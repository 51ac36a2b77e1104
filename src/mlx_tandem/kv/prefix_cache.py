"""PrefixCache: committed prompt state of earlier rows, in a trie of whole prefill chunks.

A prompt longer than one prefill chunk is prefilled chunk by chunk on its own row in block
arithmetic (engine/runner.prefill): the state after chunk n depends only on the prompt's
first (n+1)·chunk tokens. So each completed chunk is one *block* of this trie, keyed by
its tokens under its parent (the blocks before it): the block's K/V columns as each
layer's codec stores them, every recurrent layer's state at its end (a snapshot:
hybrids get reuse too) and the final hidden at its last token. A joining row whose
first n chunks walk the trie starts from those blocks' columns (concatenated) and the
n-th block's state, and prefills the rest exactly as a cold row would: warm == cold bit
for bit. Entries are fresh copies, shared read-only; a hit copies them into the row.

Memory: the bytes of every cached array count against `budget`; inserting evicts the
least recently used *leaf* blocks (a block's children need it) until the new block fits;
a block larger than the whole budget is not kept. A hit touches its whole path.

Tails: a prompt's final partial block (fewer than `block` tokens after its whole ones) is
kept too, as a leaf under its last whole block, keyed by its exact tokens: a repeated
prompt is then served whole. Only an exact match is used, never a tail that a longer
prompt merely starts with: the longer prompt's cold row computes those tokens inside a
whole block (or at other packed offsets), so only the same prompt has the same bits.

Blocks need not be of one size: `Cuts` says where a row's blocks end (the prefill's chunk
boundaries, which shrink with depth where attention over a long context would make a
fixed chunk stall the running rows; engine/prefill.PrefillPolicy).

Oracle: tests/test_prefix_cache.py (warm rows equal cold rows token for token, on
attention and hybrid tiny models; the bytes held never exceed the budget over a
200-request run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_tandem.kv.state_rows import RowSpan

Key = tuple[int, ...]


@dataclass(frozen=True)
class Cuts:
    """Where a row's blocks end. The block starting at position s holds `size` tokens, or
    with `taper` > 0, size * taper / (taper + s) (whole `align`s, at least one): the
    chunk a step can afford when each token also attends to the s before it. A pure
    function of the position: every row with the same prompt gets the same blocks."""

    size: int
    taper: int = 0
    align: int = 8

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"prefix cache block must be >= 1 token, got {self.size}")

    def at(self, start: int) -> int:
        """The size of the block that starts at `start`."""
        if not self.taper:
            return self.size
        n = self.size * self.taper // (self.taper + start)
        return min(self.size, max(self.align, n // self.align * self.align))

    def ends(self, n: int) -> list[int]:
        """The ends of the whole blocks among the first n positions, in order."""
        out, start = [], 0
        while start + self.at(start) <= n:
            start += self.at(start)
            out.append(start)
        return out

    def start_of(self, end: int) -> int:
        """Where the block holding position end - 1 starts (a whole block or a tail)."""
        ends = self.ends(end - 1)
        return ends[-1] if ends else 0


@dataclass(frozen=True)
class Block:
    """One cached chunk: its columns' state (RowSpan) and the final hidden (1, D) at its end."""

    span: RowSpan
    hidden: mx.array

    @property
    def nbytes(self) -> int:
        return self.span.nbytes + self.hidden.nbytes


@dataclass(eq=False)
class _Node:
    key: Key
    parent: _Node | None
    block: Block | None = None
    used: int = 0
    children: dict[Key, _Node] = field(default_factory=dict)


@dataclass
class PrefixStats:
    lookups: int = 0  # rows that looked their prompt up
    hits: int = 0  # of them, rows that started from at least one cached block
    lookup_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of them, tokens served from the cache (whole blocks and tails)
    inserted: int = 0
    evicted: int = 0


class PrefixCache:
    """Blocks cut by `cuts` (the prefill's chunks; an int: blocks of that many tokens),
    LRU-evicted under `budget` bytes."""

    def __init__(self, budget: int, cuts: Cuts | int) -> None:
        if budget <= 0:
            raise ValueError(f"prefix cache budget must be positive, got {budget}")
        self.budget = budget
        self.cuts = cuts if isinstance(cuts, Cuts) else Cuts(cuts)
        self.bytes = 0
        self.blocks = 0
        self.stats = PrefixStats()
        self._root = _Node((), None)
        self._clock = 0

    def _keys(self, tokens: Sequence[int]) -> tuple[list[Key], Key]:
        """The whole blocks' keys, and the tail after them (maybe empty)."""
        ends = self.cuts.ends(len(tokens))
        keys = [tuple(tokens[a:b]) for a, b in zip([0, *ends], ends, strict=False)]
        return keys, tuple(tokens[ends[-1] if ends else 0 :])

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        node.used = self._clock

    def lookup(self, tokens: Sequence[int]) -> list[Block]:
        """The cached blocks of the longest whole-block prefix of `tokens` (maybe none), and
        the tail that ends exactly at `tokens` when every whole block before it is cached."""
        keys, rest = self._keys(tokens)
        node, found = self._root, []
        for key in [*keys, rest] if rest else keys:
            child = node.children.get(key)
            if child is None or child.block is None:
                break
            self._touch(child)
            found.append(child.block)
            node = child
        self.stats.lookups += 1
        self.stats.hits += bool(found)
        self.stats.lookup_tokens += len(tokens)
        self.stats.hit_tokens += found[-1].span.end if found else 0
        return found

    def insert(self, tokens: Sequence[int], make: Callable[[], Block]) -> bool:
        """Keep the block ending `tokens` (a whole block, or the tail after the whole ones),
        built by `make()` only if it is new and its parent blocks are still cached. Returns
        whether it is cached."""
        if not tokens:
            raise ValueError("a prefix cache block needs at least one token")
        keys, rest = self._keys(tokens)
        if rest:
            keys.append(rest)
        node = self._root
        for key in keys[:-1]:
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:  # an ancestor was evicted: this block cannot be reached
                return False
        if keys[-1] in node.children:
            self._touch(node.children[keys[-1]])
            return True
        block = make()
        need = block.nbytes
        if need > self.budget or not self._make_room(need, node):
            return False
        child = _Node(keys[-1], node, block)
        node.children[keys[-1]] = child
        self._touch(child)
        self.bytes += need
        self.blocks += 1
        self.stats.inserted += 1
        return True

    def _make_room(self, need: int, keep: _Node) -> bool:
        """Evict least recently used leaves (never `keep` or its ancestors) until `need` fits."""
        protected = set()
        node: _Node | None = keep
        while node is not None:
            protected.add(id(node))
            node = node.parent
        while self.bytes + need > self.budget:
            leaves = [n for n in self._nodes() if not n.children and id(n) not in protected]
            if not leaves:
                return False
            self._evict(min(leaves, key=lambda n: n.used))
        return True

    def _evict(self, node: _Node) -> None:
        assert node.parent is not None and node.block is not None
        del node.parent.children[node.key]
        self.bytes -= node.block.nbytes
        self.blocks -= 1
        self.stats.evicted += 1
        node.block = None

    def _nodes(self) -> list[_Node]:
        out, todo = [], list(self._root.children.values())
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(n.children.values())
        return out

    def clear(self) -> None:
        for n in self._nodes():
            n.block = None
        self._root.children.clear()
        self.bytes = self.blocks = 0

    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache."""
        return self.stats.hit_tokens / max(1, self.stats.lookup_tokens)
