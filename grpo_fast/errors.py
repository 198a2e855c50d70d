"""What an error wraps: one walk over an exception, its causes and contexts, and the per-rank failures
torch.distributed.checkpoint collects, used where the cause decides what to say (a full disk, a dead peer)."""

from __future__ import annotations

from typing import Iterator


def chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then everything it wraps, each once."""
    pending, seen = [err], set()
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        pending += [err.__cause__, err.__context__, *(exc for exc, _ in getattr(err, "failures", {}).values())]
