"""``train.overfit_batches`` (debug=overfit): the first few batches of a train iterator, given
over and over. A model that cannot drive its loss down on them has a bug, whatever the data.
The position it reports and restores is its source's (the batches it read), so a checkpoint's
data position stays one the iterator without it understands.
"""

from __future__ import annotations

from typing import Any


class Repeated:
    def __init__(self, source: Any, n: int):
        self.source, self.n = source, n
        self.kept: list[Any] = []
        self.i = 0

    def __iter__(self) -> Repeated:
        return self

    def __next__(self) -> Any:
        if len(self.kept) < self.n:
            self.kept.append(next(self.source))
        batch = self.kept[self.i % self.n]
        self.i += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return self.source.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.source.set_state(state)

    def close(self) -> None:
        if hasattr(self.source, "close"):
            self.source.close()
