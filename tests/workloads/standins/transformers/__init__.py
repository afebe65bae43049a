"""Stand-in for `transformers` (see ../README.md): `TrainerCallback` with the real class's step events, each doing
nothing, as the real base class's do; `TrainingArguments` with the two fields the gpuwatch adapter reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TrainingArguments:
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1


class TrainerCallback:
    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        pass

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        pass

    def on_substep_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        pass

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        pass
