"""PrefixTree: the cached blocks of the Python placement engine, as a tree.

A block is cached while some tier holds it. Each cached block has a size and
a parent (None for a root), cached too; the tree keeps, per cached parent,
its cached children in the order they were linked (a dict as an ordered
set: drops and evictions walk them in that order), and tells a watcher
when a key enters or leaves it (what `lookup` and `contains` answer).
Which tiers hold a block, and every decision, are the engine's
(ucm/placement/engine.py, ucm/placement/residency.py).

Not thread-safe: the engine's owner serialises calls.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from ucm.placement.heat import Key

__all__ = ["PrefixTree"]


class PrefixTree:
    """Cached keys with their parents, sizes and cached children."""

    def __init__(self) -> None:
        self._parent: dict[Key, Optional[Key]] = {}  # cached key -> parent
        self._children: dict[Key, dict[Key, None]] = {}  # cached parent -> cached children, in link order
        self._size: dict[Key, int] = {}
        self._on_link: Optional[Callable[[Key], None]] = None
        self._on_unlink: Optional[Callable[[Key], None]] = None

    # ---- queries -----------------------------------------------------------
    def contains(self, key: Key) -> bool:
        return key in self._parent

    def parent_of(self, key: Key) -> Optional[Key]:
        """The parent of a cached key (None for a root or an unknown key)."""
        return self._parent.get(key)

    def size_of(self, key: Key) -> Optional[int]:
        return self._size.get(key)

    def has_children(self, key: Key) -> bool:
        return key in self._children

    def children_of(self, key: Key) -> Iterable[Key]:
        """The cached children of `key`, in the order they were linked."""
        return self._children.get(key, ())

    def lookup(self, keys: Sequence[Key]) -> int:
        """How many of `keys`, from the first, are cached."""
        cached = self._parent
        n = 0
        for k in keys:
            if k not in cached:
                break
            n += 1
        return n

    def children_first(self, group: dict[Key, None]) -> list[Key]:
        """The keys of `group` ordered so that each comes after every one of
        its descendants in the group."""
        order: list[Key] = []
        stack = [(k, False) for k in group if self._parent.get(k) not in group]
        while stack:
            k, expanded = stack.pop()
            if expanded:
                order.append(k)
                continue
            stack.append((k, True))
            stack.extend((c, False) for c in self._children.get(k, ()) if c in group)
        return order

    def subtree(self, key: Key) -> list[Key]:
        """`key` and its cached descendants, deepest first (`key` last)."""
        children = self._children
        stack = [key]
        order: list[Key] = []
        while stack:
            k = stack.pop()
            order.append(k)
            kids = children.get(k)
            if kids:
                stack.extend(kids)
        order.reverse()
        return order

    # ---- changes -----------------------------------------------------------
    def watch(self, on_link: Callable[[Key], None], on_unlink: Callable[[Key], None]) -> None:
        """Calls on_link(key) for every cached key now and whenever one
        enters the tree, on_unlink(key) when one leaves it, synchronously."""
        for key in self._parent:
            on_link(key)
        self._on_link, self._on_unlink = on_link, on_unlink

    def link(self, key: Key, parent: Optional[Key], size: int) -> None:
        """`key` (of `size` bytes, behind `parent`) is cached."""
        if self._on_link is not None and key not in self._parent:
            self._on_link(key)
        self._parent[key] = parent
        self._size[key] = size
        if parent is not None:
            kids = self._children.get(parent)
            if kids is None:
                self._children[parent] = {key: None}
            else:
                kids[key] = None

    def unlink(self, key: Key) -> None:
        """`key`, cached, left its last tier."""
        parent = self._parent.pop(key)
        if self._on_unlink is not None:
            self._on_unlink(key)
        self._size.pop(key, None)
        if parent is not None:
            kids = self._children.get(parent)
            if kids is not None:
                kids.pop(key, None)
                if not kids:
                    del self._children[parent]
