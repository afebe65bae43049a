"""The order in which each stage runs forward (F) and backward (B) passes under both schedules."""

import pytest

from gpuwatch.trainer.config import ModelConfig, TrainConfig
from gpuwatch.trainer.launch import launch
from gpuwatch.trainer.parallel.groups import build_grid
from gpuwatch.trainer.parallel.pipeline import Pipeline
from gpuwatch.trainer.train import Trainer

MODEL = ModelConfig(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=4)


def _trace(device, cfg: TrainConfig):
    """Run one step with _forward/_backward wrapped to log micro-batch numbers and activations alive."""
    grid = build_grid(cfg.tp, cfg.pp, cfg.dp)
    trainer = Trainer(cfg, grid, device)
    batches = trainer.next_micro_batches()
    events, alive, peak, number_of = [], [0], [0], {}
    forward, backward = Pipeline._forward, Pipeline._backward

    def traced_forward(self, x, batch, scale):
        index = next(i for i, b in enumerate(batches) if b is batch)
        output = forward(self, x, batch, scale)
        number_of[id(output)] = index
        events.append(f"F{index}")
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        return output

    def traced_backward(self, x, output, output_grad):
        events.append(f"B{number_of[id(output)]}")
        alive[0] -= 1
        return backward(self, x, output, output_grad)

    trainer.pipeline._forward = traced_forward.__get__(trainer.pipeline)
    trainer.pipeline._backward = traced_backward.__get__(trainer.pipeline)
    trainer.pipeline.run(batches)
    return grid.pp_rank, " ".join(events), peak[0]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("gpipe", {0: ("F0 F1 F2 F3 B0 B1 B2 B3", 4), 1: ("F0 F1 F2 F3 B0 B1 B2 B3", 4)}),
        # 1F1B: stage 0 runs pp - 1 = 1 extra forward first, the last stage alternates from the start
        ("1f1b", {0: ("F0 F1 B0 F2 B1 F3 B2 B3", 2), 1: ("F0 B0 F1 B1 F2 B2 F3 B3", 1)}),
    ],
)
def test_schedule_order_and_activations_alive_per_stage(schedule, expected):
    cfg = TrainConfig(model=MODEL, pp=2, micro_batches=4, global_batch=8, schedule=schedule)
    for stage, order, peak in launch(_trace, 2, cfg, device="cpu", timeout=60):
        assert (order, peak) == expected[stage]


def test_1f1b_with_more_stages_than_micro_batches():
    cfg = TrainConfig(model=MODEL, pp=4, micro_batches=2, global_batch=4, schedule="1f1b")
    traces = {stage: (order, peak) for stage, order, peak in launch(_trace, 4, cfg, device="cpu", timeout=60)}
    assert traces == {
        0: ("F0 F1 B0 B1", 2),  # warm-up capped at m
        1: ("F0 F1 B0 B1", 2),
        2: ("F0 F1 B0 B1", 2),  # pp - stage - 1 = 1: one forward ahead
        3: ("F0 B0 F1 B1", 1),
    }
