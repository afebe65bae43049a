"""Stand-in for `lightning.pytorch` (see ../../README.md): `Callback` with the real class's batch events, each doing
nothing, as the real base class's do."""

from __future__ import annotations

from typing import Any


class Callback:
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        pass

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pass
