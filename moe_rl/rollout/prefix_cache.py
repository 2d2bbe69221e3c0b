"""SGLang's radix (prefix) cache for `LocalEngine`: prompts that start with tokens already computed reuse
their keys, values and routes.

Semantics are SGLang 0.5.23's (mem_cache/radix_cache.py, schedule_batch.py, scheduler.py):
- a request matches at most `len(tokens) - 1` tokens (the last one is computed for its logits), fewer
  when it asks for prompt log-probs from `logprob_start_len` (`Req._compute_max_prefix_len`);
- after its prefill the prompt is inserted (`checkpoint_kv_cache`), and when it finishes the prompt and
  every output token whose KV was computed (all but the last); a retracted or aborted request inserts
  no output (`release_kv_cache(checkpoint=False)`);
- an insert never replaces a cached prefix: the KV and routes of a cached token are those of the forward
  that first computed it, under the weights of that moment, until `/flush_cache` empties the cache
  (SGLang captures routes per KV slot: state_capturer/routed_experts.py);
- a flush needs an idle engine, so KV computed before a flush is never inserted after it (`epoch`);
- the cache is bounded (`max_tokens`, SGLang's --max-total-tokens): least recently used leaves go first.

Written here, not taken from SGLang, because SGLang's tree indexes slots of a CUDA token pool; this one
holds the tensors themselves (per node: keys and values of every layer, routes of every MoE layer) for
HF transformers' `DynamicCache`. Page size 1.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

import torch


class _Node:
    __slots__ = ("key", "keys", "values", "routes", "children", "parent", "last_use")

    def __init__(self, key: tuple[int, ...], keys: torch.Tensor | None, values: torch.Tensor | None,
                 routes: torch.Tensor | None, parent: "_Node | None"):
        self.key = key          # the edge's tokens
        self.keys = keys        # [layers, kv_heads, len(key), head_dim]
        self.values = values    # [layers, kv_heads, len(key), v_head_dim]
        self.routes = routes    # [len(key), moe_layers, topk] or None (a dense model)
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_use = 0

    def split(self, at: int) -> "_Node":
        """Cut this edge after `at` tokens: the head becomes a new parent of this node; returns the head."""
        head = _Node(self.key[:at], self.keys[:, :, :at], self.values[:, :, :at],
                     None if self.routes is None else self.routes[:at], self.parent)
        head.last_use = self.last_use
        head.children[self.key[at]] = self
        self.parent.children[self.key[0]] = head
        self.key, self.keys, self.values = self.key[at:], self.keys[:, :, at:], self.values[:, :, at:]
        self.routes = None if self.routes is None else self.routes[at:]
        self.parent = head
        return head


@dataclass
class PrefixHit:
    """The cached start of a token sequence: `length` tokens, their keys and values per layer
    ([layers, kv_heads, length, head_dim]) and routes ([length, moe_layers, topk] or None)."""

    length: int
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    routes: torch.Tensor | None = None


class PrefixCache:
    """A radix tree of token sequences whose keys, values and routes are cached."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.root = _Node((), None, None, None, None)
        self.tokens = 0          # tokens held
        self.epoch = 0           # bumped by every reset (a flush)
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    def match(self, tokens: Sequence[int], limit: int) -> PrefixHit:
        """The longest cached prefix of `tokens[:limit]`, copied out (the cache may evict it later)."""
        with self._lock:
            node, at, parts = self.root, 0, []
            tokens = list(tokens[:max(0, limit)])
            now = next(self._clock)
            while at < len(tokens):
                child = node.children.get(tokens[at])
                if child is None:
                    break
                n = _common(child.key, tokens, at)
                child.last_use = now
                parts.append((child, n))
                at += n
                if n < len(child.key):
                    break
                node = child
            if not at:
                return PrefixHit(0)
            keys = torch.cat([c.keys[:, :, :n] for c, n in parts], dim=2)
            values = torch.cat([c.values[:, :, :n] for c, n in parts], dim=2)
            routes = None if parts[0][0].routes is None else torch.cat([c.routes[:n] for c, n in parts], 0)
            return PrefixHit(at, keys, values, routes)

    def insert(self, tokens: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
               routes: torch.Tensor | None, epoch: int) -> int:
        """Cache `tokens` with their keys and values ([layers, kv_heads, len, dim]) and routes ([len, L, k]);
        the part already cached keeps what it holds. Nothing is inserted when a flush happened since the
        KV was computed (`epoch` is the cache's epoch then). Returns the number of tokens added."""
        tokens = list(tokens)
        if not tokens or keys.shape[2] != len(tokens):
            return 0
        with self._lock:
            if epoch != self.epoch:
                return 0
            now = next(self._clock)
            node, at = self.root, 0
            while at < len(tokens):
                child = node.children.get(tokens[at])
                if child is None:
                    break
                n = _common(child.key, tokens, at)
                if n < len(child.key):
                    child = child.split(n)
                child.last_use = now
                node, at = child, at + n
            if at == len(tokens):
                return 0
            new = _Node(tuple(tokens[at:]), keys[:, :, at:].clone(), values[:, :, at:].clone(),
                        None if routes is None else routes[at:].clone(), node)
            new.last_use = now
            node.children[tokens[at]] = new
            self.tokens += len(new.key)
            self._evict()
            return len(tokens) - at

    def reset(self) -> None:
        """Empty the cache (SGLang's flush_cache)."""
        with self._lock:
            self.root = _Node((), None, None, None, None)
            self.tokens = 0
            self.epoch += 1

    def _evict(self) -> None:
        """Drop least recently used leaves until at most max_tokens are held (whole nodes, as SGLang's
        evict does); a parent left without children becomes a leaf in its turn."""
        if self.tokens <= self.max_tokens:
            return
        heap = [(n.last_use, id(n), n) for n in _leaves(self.root)]
        heapq.heapify(heap)
        while self.tokens > self.max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))


def _common(key: tuple[int, ...], tokens: list[int], at: int) -> int:
    n = 0
    while n < len(key) and at + n < len(tokens) and key[n] == tokens[at + n]:
        n += 1
    return n


def _leaves(node: _Node):
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        if n.children:
            stack.extend(n.children.values())
        else:
            yield n
