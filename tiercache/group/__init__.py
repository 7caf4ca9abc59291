"""Many ranks: save and restore as a torch.distributed process group (docs/design.md section 7).

:class:`GroupView` is what ``cache.save(state, step=..., group=g)`` and ``cache.restore(ref,
group=g)`` go through; every exchange among its ranks goes through one collective layer
(:mod:`tiercache.group.collective`).
"""

from tiercache.group.view import DEFAULT_TIMEOUT, REPLICATED, GroupView

__all__ = ["DEFAULT_TIMEOUT", "REPLICATED", "GroupView"]
