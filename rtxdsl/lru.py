"""One bounded LRU for every cache in rtxdsl (plans, launches, kernels, gradient plans).

``functools.lru_cache`` memoizes a function; these caches are keyed maps whose values are
built by the caller and whose bound may change with the config, so a small OrderedDict
wrapper with a lock and counters is the honest tool.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A thread-safe map holding at most ``capacity`` entries, least recently used evicted first.

    Example:
        >>> c = LRU(2)
        >>> c.put("a", 1); c.put("b", 2); c.get("a")
        1
        >>> c.put("c", 3)
        >>> sorted(c.keys()), c.evictions
        (['a', 'c'], 1)
    """

    __slots__ = ("_data", "_lock", "capacity", "hits", "misses", "evictions")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {capacity}")
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.capacity = capacity
        self.hits = self.misses = self.evictions = 0

    def get(self, key: K) -> V | None:
        # lock-free: dict lookups and move_to_end are atomic under the GIL; a concurrent eviction
        # between them only loses this entry's recency
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        try:
            self._data.move_to_end(key)
        except KeyError:
            pass
        self.hits += 1
        return value

    def peek(self, key: K) -> V | None:
        """The value under ``key`` without touching the order or the counters."""
        with self._lock:
            return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)
                self.evictions += 1

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = max(1, capacity)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)
                self.evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._data)

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data
