"""A plug-in eviction policy as the block store calls it: its bugs never reach the table.

The store tells its eviction policies of every change under its lock, between the steps of
that change: a new block is committed, then inserted; a demotion's source is dropped, then
removed; room is made with the victims ``evict`` names. A plug-in that raised there (a bug)
left the step half done. In one case found by a fault-injection run: ``new_blocks``
committed and pinned a slot, then the policy's ``insert`` raised, and the block stayed in
the table, pinned for good and READY with whatever bytes its slot held before. A victim the
policy may not evict (pinned, being written) would be moved or dropped all the same.

So a policy class that tiercache does not ship is called through ``GuardedPolicy``. When
it raises, or ``evict`` breaks its contract, the guard

- logs the error with its traceback, once;
- puts ``lru`` in its place, ranking the blocks the table holds READY on the tier at that
  moment (a policy that raised is in an unknown state; its ranking is lost);
- answers the call that failed from ``lru`` (``evict``'s victims), so the store's step
  completes;
- hands a ``PolicyError`` to the store, which raises it from its next public call that
  starts work, on any thread, or from ``close()`` (``BlockStore._raise_policy_failure``):
  the call that met the failure completes.

The data stay exact and the store keeps working; the user learns of the bug at once, and a
comparison of policies does not go on quietly measuring ``lru``.

Plug-ins of the other kinds are not called in the middle of the store's changes: their
answers are checked before they are used (``plugin_answer``: a selection's pages, a
retention's tokens, a prefetch plan), and a breach is a ``PolicyError`` at once.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Callable, Hashable, Iterable, Optional

from tiercache.errors import PolicyError
from tiercache.policies import EvictionPolicy, LRUPolicy

log = logging.getLogger("tiercache")

FALLBACK = "lru"  # LRUPolicy itself, not what the registry holds under "lru" (a user may replace it)


def is_plugin(policy: object) -> bool:
    """True for a policy (of any kind) whose class tiercache does not ship: the store calls
    such an eviction policy through ``GuardedPolicy``, and checks the answers of such a
    prefetch, selection or retention policy (``plugin_answer``)."""
    return is_plugin_class(type(policy))


def is_plugin_class(cls: type) -> bool:
    """True for a policy class that tiercache does not ship (see ``is_plugin``)."""
    return not cls.__module__.startswith("tiercache.policies.")


def plugin_answer(kind: str, name: str, method: str, call: Callable[[], object],
                  breach: Callable[[object], str]) -> object:
    """``call()``, a plug-in ``kind`` policy's ``method``, checked: its exception, or the
    breach of its contract that ``breach(answer)`` describes (else ""), is raised as a
    ``PolicyError`` naming the policy, before the answer is used (a selection's pages, a
    retention's tokens: a wrong one would be a torch error from deep inside, or silently
    wrong tokens)."""
    try:
        answer = call()
    except Exception as exc:  # noqa: BLE001 - a plug-in's bug, named
        raise PolicyError(f"the {kind} policy {name!r} failed in {method}: {type(exc).__name__}: {exc}") from exc
    problem = breach(answer)
    if problem:
        raise PolicyError(f"the {kind} policy {name!r} broke the contract of {method}: {problem}")
    return answer


def as_plan(plan: object) -> object:
    """A prefetch policy's ``plan`` as a list, if it is an iterable of keys (a list, a
    tuple, a set, a generator); anything else as it is, for ``plan_breach`` to name."""
    if isinstance(plan, list) or not isinstance(plan, Iterable) or isinstance(plan, (str, bytes, Mapping)):
        return plan
    return list(plan)


def plan_breach(plan: object) -> str:
    """What is wrong with a prefetch policy's plan (after ``as_plan``), or "": it must be a
    list of block keys. A key the cache does not hold is skipped."""
    if not isinstance(plan, list):
        return f"it returned {type(plan).__name__}, not a list of block keys"
    for key in plan:
        try:
            hash(key)
        except TypeError:
            return f"it named {key!r}, which is not a block key (not hashable)"
    return ""


class _Wrapped(EvictionPolicy):
    """A plug-in eviction policy ``inner`` behind ``_call(method, *args)``, which each
    subclass defines: every call but ``evict`` and ``__len__`` goes through it."""

    inner: EvictionPolicy
    wants_scores: bool

    def _call(self, method: str, *args):  # pragma: no cover - overridden
        raise NotImplementedError

    def insert(self, key: Hashable) -> None:
        self._call("insert", key)

    def touch(self, key: Hashable) -> None:
        self._call("touch", key)

    def remove(self, key: Hashable) -> None:
        self._call("remove", key)

    # The batch calls hand the plug-in copies: the store goes on with its own lists after
    # them (``touch_many``'s keys are pinned next), so a plug-in that consumed or kept and
    # changed one made the store unpin blocks it never pinned (a review).
    def insert_many(self, keys: Iterable[Hashable]) -> None:
        self._call("insert_many", tuple(keys))

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        self._call("touch_many", tuple(keys))

    def remove_many(self, keys: Iterable[Hashable]) -> None:
        self._call("remove_many", tuple(keys))

    def observe_scores(self, scores) -> None:
        if self.wants_scores:  # every tier's policy hears the same mapping: each gets its own
            self._call("observe_scores", dict(scores))


class GuardedPolicy(_Wrapped):
    """``inner``, the plug-in eviction policy registered as ``name``, for ``tier`` (a label),
    called so that it never raises into the store (see the module's doc). ``ready_keys()``
    returns the keys READY on the tier (under the store's lock, as every call here is);
    ``report(error)`` receives the ``PolicyError`` of the first failure."""

    def __init__(self, inner: EvictionPolicy, name: str, tier: str, ready_keys: Callable[[], Iterable[Hashable]],
                 report: Callable[[PolicyError], None], role: str = "") -> None:
        self.inner = inner
        self.name = name  # as registered (a plug-in subclass may inherit its parent's ``name``)
        self.tier = tier
        self.role = role  # the store's, where it is not a cache's own: "the prefix cache's store"
        self.wants_scores = inner.wants_scores
        self.assumes_layer_scan = inner.assumes_layer_scan
        self.failure: Optional[PolicyError] = None
        self._ready_keys = ready_keys
        self._report = report

    def _failed(self, method: str, exc: Exception) -> None:
        """``inner`` failed in ``method``: ``lru`` takes its place, ranking what the tier holds."""
        if self.role:  # the prefix cache's store outlives the caches that use it: a new cache did
            # not help (a review: two more runs went on with lru in silence); closing the store does
            where = f" of {self.role}"
            remedy = f"; fix the policy and close {self.role} (tiercache.prefix.close_all()), which the process's " \
                     f"caches share"
        else:
            where, remedy = "", "; fix the policy and make a new cache"
        error = PolicyError(f"the eviction policy {self.name!r} of the {self.tier} tier{where} failed in "
                            f"{method}: {type(exc).__name__}: {exc}. No data were lost: the {self.tier} tier "
                            f"evicts with {FALLBACK!r} from now on{remedy}")
        error.__cause__ = exc
        log.error("tiercache: %s", error, exc_info=exc)
        fallback = LRUPolicy()
        fallback.insert_many(self._ready_keys())
        self.inner = fallback
        self.wants_scores = False
        self.failure = error
        self._report(error)

    def _call(self, method: str, *args) -> None:
        try:
            getattr(self.inner, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a plug-in's bug; the table already holds the change
            if self.failure is not None:  # lru's own: a bug of tiercache's
                raise
            self._failed(method, exc)

    def evict(self, n: int, is_evictable: Callable[[Hashable], bool]) -> Optional[list]:
        """The plug-in's victims, checked: ``n`` distinct keys that ``is_evictable`` allows,
        or None when fewer than ``n`` blocks are evictable (counted over the tier, on that
        rare path only). Anything else (or an exception) is a failure, answered by ``lru``."""
        if self.failure is not None:  # lru in the plug-in's place: tiercache's own, not checked
            return self.inner.evict(n, is_evictable)
        try:
            victims = self.inner.evict(n, is_evictable)
            if victims is not None:
                victims = list(victims)
                wrong = evict_breach(victims, n, is_evictable)
            else:  # None: fewer than n evictable, which the store then believes
                evictable = sum(1 for key in self._ready_keys() if is_evictable(key))
                wrong = f"evict({n}) returned None with {evictable} blocks evictable" if evictable >= n else ""
            if wrong:
                raise ValueError(wrong)
            return victims
        except Exception as exc:  # noqa: BLE001 - a plug-in's bug, or a broken contract
            self._failed("evict", exc)
            return self.inner.evict(n, is_evictable)

    def __len__(self) -> int:
        try:
            return len(self.inner)
        except Exception as exc:  # noqa: BLE001 - the same
            if self.failure is not None:
                raise
            self._failed("__len__", exc)
            return len(self.inner)


def evict_breach(victims: list, n: int, is_evictable: Callable[[Hashable], bool]) -> str:
    """What is wrong with ``evict``'s answer, or "" (``EvictionPolicy.evict``'s contract)."""
    for key in victims:
        try:
            hash(key)
        except TypeError:
            return f"evict({n}) named {key!r}, which is not a block key (not hashable)"
    if len(set(victims)) != len(victims):
        return f"evict({n}) named a block twice: {victims!r}"
    if len(victims) != n:
        return f"evict({n}) returned {len(victims)} victims"
    for key in victims:
        if not is_evictable(key):
            return f"evict({n}) named {key!r}, which may not be evicted now (pinned, protected or not there)"
    return ""


class CheckedPolicy(_Wrapped):
    """``inner``, a plug-in eviction policy registered as ``name``, where a wrong answer
    must stop the run rather than be replaced: the policy lab's replay
    (``tiercache.lab.sim``), whose whole output is what the policy decided. Its exception,
    or ``evict``'s breach of its contract (as ``GuardedPolicy`` checks it), is a
    ``PolicyError`` naming the policy, the tier and the method, raised at once; a replay
    that went on with ``lru`` answering would report ``lru``'s figures under the plug-in's
    name. ``keys()`` returns the keys on the tier (for an ``evict`` that answers None)."""

    def __init__(self, inner: EvictionPolicy, name: str, tier: str, keys: Callable[[], Iterable[Hashable]]) -> None:
        self.inner = inner
        self.name = name
        self.tier = tier
        self.wants_scores = inner.wants_scores
        self.assumes_layer_scan = inner.assumes_layer_scan
        self._keys = keys

    def _call(self, method: str, *args, breach: Callable[[object], str] = lambda _: ""):
        return plugin_answer("eviction", self.name, f"{method} (the {self.tier} tier)",
                             lambda: getattr(self.inner, method)(*args), breach)

    def evict(self, n: int, is_evictable: Callable[[Hashable], bool]) -> Optional[list]:
        def breach(victims: object) -> str:
            if victims is None:
                evictable = sum(1 for key in self._keys() if is_evictable(key))
                return f"evict({n}) returned None with {evictable} blocks evictable" if evictable >= n else ""
            if not isinstance(victims, list):
                return f"evict({n}) returned {type(victims).__name__}, not a list of block keys"
            return evict_breach(victims, n, is_evictable)
        # a generator or a tuple is read into a list once, before it is checked
        return plugin_answer("eviction", self.name, f"evict (the {self.tier} tier)",
                             lambda: as_plan(self.inner.evict(n, is_evictable)), breach)

    def __len__(self) -> int:
        return self._call("__len__")
