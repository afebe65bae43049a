"""What `gpuwatch run` injects into a rank (gpuwatch.trainer.auto): when it activates, which collectives it times,
how it ends, and what layout it reads from a device mesh.

* Activation never depends on import order or on import-time probes: `import transformers` looks torch up with
  `importlib.util.find_spec` before importing it; accelerate, Lightning and pytorch_lightning import it at once;
  scripts import it inside a function, ask `importlib.metadata` for its version, or run as `python -m`.
* Every collective the installed torch.distributed exports is wrapped, found from torch itself: a test fails when a
  collective of torch's is left unwrapped. Run by a real 2-rank gloo job, every entry point (blocking, asynchronous
  and waited for, `*_single`, `*_into_tensor`, `*_coalesced`, point-to-point, object collectives) is counted under
  its op, and a rank that hangs inside an asynchronous collective's `Work.wait()` is named with that collective.
* `destroy_process_group(None)`, the default group given positionally (accelerate's `end_training`), closes the
  Monitor.
* A one-dimensional device mesh without names over the world (FSDP2's default) is data parallel; a mesh that is no
  tp × pp × dp layout is a note in the hello.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import foreign
import pytest
import torch
import torch.distributed as dist
from foreign import GPUWATCH_RUN, WORKLOADS

from gpuwatch.protocol.schema import COLLECTIVE_OPS, P2P_OPS
from gpuwatch.trainer.auto import instrumented_environment, pipelining
from gpuwatch.trainer.auto import layout as layout_module
from gpuwatch.trainer.auto.collectives import (
    NAMESPACES,
    collective_functions,
    functional_collective_ops,
    op_of,
    takes_async_op,
)
from gpuwatch.trainer.hooks.progress import MIN_STEPS

from conftest import wait_until

#: The probe a Python process runs after its own imports: whether gpuwatch instrumented it once torch came in.
ACTIVE = "from gpuwatch.trainer.auto import instrument; print('active' if instrument.active else 'inactive')"


def _instrumented_python(*arguments: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = instrumented_environment(os.environ, new_job="import-order")
    env.pop("GPUWATCH_RUN_STATUS", None)
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=120,
                          cwd=cwd)


@pytest.mark.integration
@pytest.mark.parametrize("first_import", [
    "import transformers",  # asks importlib.util.find_spec('torch') first, imports torch later (its lazy modules)
    "import transformers; from transformers import PretrainedConfig",
    "import accelerate",
    "import lightning",
    "import pytorch_lightning",
    "import importlib.util; importlib.util.find_spec('torch'); importlib.util.find_spec('torch')",
    "import importlib.metadata; importlib.metadata.version('torch')",
])
def test_activation_does_not_depend_on_what_is_imported_first(first_import):
    result = _instrumented_python("-c", f"{first_import}\nimport torch\n{ACTIVE}")
    assert result.stdout.split()[-1:] == ["active"], result.stderr[-3000:]


@pytest.mark.integration
def test_torch_imported_inside_a_function_or_by_a_module_run_with_dash_m(tmp_path):
    (tmp_path / "job.py").write_text(f"def train():\n    import torch\n    {ACTIVE}\n\n\ntrain()\n")
    as_script = _instrumented_python(str(tmp_path / "job.py"))
    as_module = _instrumented_python("-m", "job", cwd=tmp_path)
    assert as_script.stdout.split() == ["active"], as_script.stderr[-3000:]
    assert as_module.stdout.split() == ["active"], as_module.stderr[-3000:]


@pytest.mark.integration
def test_a_process_that_never_imports_torch_is_left_alone():
    result = _instrumented_python("-c", "import importlib.util, sys; importlib.util.find_spec('torch'); "
                                        "print('torch' in sys.modules, [type(f).__name__ for f in sys.meta_path][0])")
    assert result.stdout.split() == ["False", "_AfterTorchImport"], result.stderr[-3000:]


# -- collectives ---------------------------------------------------------------------------------------------------

def _takes_async_op(module: ModuleType) -> set[str]:
    return {name for name in dir(module) if not name.startswith("_") and takes_async_op(getattr(module, name))}


def test_every_collective_the_installed_torch_exports_is_wrapped():
    """The set is read from torch: every public function of torch.distributed that takes `async_op` is one, and each
    must count as an op the record knows; so are the point-to-point calls."""
    wrapped = collective_functions()
    assert _takes_async_op(dist.distributed_c10d) - set(wrapped) == set()
    assert {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_reduce_coalesced", "all_to_all_single", "isend", "irecv", "send", "recv"} <= set(wrapped)
    assert set(wrapped.values()) <= set(COLLECTIVE_OPS)
    assert set(COLLECTIVE_OPS) <= set(wrapped.values())


def test_a_collective_whose_name_fits_no_op_would_be_left_unwrapped_and_fail_the_test_above():
    future = ModuleType("future_c10d")
    future.all_frobnicate = lambda tensor, group=None, async_op=False: None  # type: ignore[attr-defined]
    future.reduce_scatter_v = lambda output, inputs, group=None, async_op=False: None  # type: ignore[attr-defined]
    assert _takes_async_op(future) - set(collective_functions(future)) == {"all_frobnicate"}
    assert (op_of("reduce_scatter_v"), op_of("reduce"), op_of("all_gather_object")) == ("reduce_scatter", "reduce",
                                                                                         "all_gather")


def test_every_functional_collective_the_dispatcher_knows_counts_as_an_op():
    """DTensor's collectives: every public op of the functional namespaces the installed torch registers launches a
    collective the record knows, but `wait_tensor`, which is the wait; a new op of another name fails here."""
    ops = functional_collective_ops()
    every = {tuple(name.split("::")) for name in torch._C._dispatch_get_all_op_names()
             if name.split("::")[0] in NAMESPACES and not name.split("::")[1].startswith("_")}
    assert set(ops) == every
    assert {name for name, op in ops.items() if op is None} == {("_c10d_functional", "wait_tensor")}
    assert {op for op in ops.values() if op is not None} <= set(COLLECTIVE_OPS)
    assert {("_c10d_functional", "all_reduce"), ("_c10d_functional", "all_gather_into_tensor"),
            ("_c10d_functional", "reduce_scatter_tensor"), ("_c10d_functional", "all_to_all_single"),
            ("_c10d_functional_autograd", "all_gather_into_tensor")} <= set(ops)
    future = functional_collective_ops(["_c10d_functional::all_frobnicate", "_c10d_functional::reduce_scatter_v",
                                        "_c10d_functional::_private", "aten::add"])
    assert future == {("_c10d_functional", "all_frobnicate"): None, ("_c10d_functional", "reduce_scatter_v"):
                      "reduce_scatter"}


def test_after_install_every_functional_collective_keeps_its_identity_and_is_routed():
    """Routed in place: the op objects torch made stay the same objects, with the same overloads (torch's tables
    key on `.default`), and each call goes through the hooks."""
    probe = ("import json, torch, torch.distributed as dist\n"
             "from gpuwatch.trainer.auto.collectives import functional_collective_ops\n"
             "from torch._ops import OpOverloadPacket\n"
             "ops = [getattr(getattr(torch.ops, ns), name) for ns, name in functional_collective_ops()]\n"
             "print(json.dumps([len(ops), sum(type(op).__name__ == '_Timed' for op in ops),"
             " all(isinstance(op, OpOverloadPacket) and op.default.overloadpacket is op for op in ops)]))\n")
    result = _instrumented_python("-c", probe)
    assert json.loads(result.stdout) == [len(functional_collective_ops()), len(functional_collective_ops()), True], \
        result.stderr[-3000:]


def test_after_install_every_entry_point_and_work_wait_are_the_wrappers():
    probe = ("import json, torch, torch.distributed as dist\n"
             "from gpuwatch.trainer.auto.collectives import collective_functions\n"
             "names = collective_functions()\n"
             "bare = [n for n in names if not hasattr(getattr(dist.distributed_c10d, n), '__wrapped__')"
             " or (hasattr(dist, n) and getattr(dist, n) is not getattr(dist.distributed_c10d, n))]\n"
             "print(json.dumps([len(names), bare, hasattr(dist.Work.wait, '__wrapped__')]))\n")
    result = _instrumented_python("-c", probe)
    assert json.loads(result.stdout) == [len(collective_functions()), [], True], result.stderr[-3000:]


def _every_collective(run_log: Path, *args: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUWATCH_")}
    command = [*GPUWATCH_RUN[:-1], "--run-log", str(run_log), "--job", "every-collective", "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKLOADS / "every_collective.py"), *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(run_log: Path, rank: int) -> list[dict]:
    path = run_log / f"rank-{rank:05d}.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]  # a rank may be writing the last


@pytest.mark.integration
def test_every_entry_point_is_counted_under_its_op_and_the_job_closes_on_a_positional_shutdown(tmp_path):
    job = _every_collective(tmp_path, "--steps", "3")
    output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output[-4000:]
    per_step = {"all_gather": 5,  # _single (async, waited), _into_tensor, the list form, all_gather_object's two
                "reduce_scatter": 2, "all_reduce": 2, "all_to_all": 1, "broadcast": 1, "reduce": 1, "gather": 1,
                "scatter": 1, "barrier": 1}
    for rank, p2p in ((0, "send"), (1, "recv")):
        records = _records(tmp_path, rank)
        steps = [r for r in records if r["kind"] == "step"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        for step in steps:
            counts = {op: calls["count"] for op, calls in step["collectives"].items()}
            assert counts == {**per_step, p2p: 2}, (rank, step["step"], counts)
            assert step["collective_calls"] == {"default": sum(per_step.values()) * step["step"]}
            assert not set(counts) & P2P_OPS - {p2p}
        # closed by destroy_process_group(None), before the process ended: the last record says so
        assert records[-1]["kind"] == "progress" and records[-1]["phase"] == "closed"


@pytest.mark.integration
def test_a_rank_hanging_inside_an_asynchronous_collectives_wait_is_named_with_it(tmp_path):
    # past the hooks' MIN_STEPS steps, a hang is overdue after OVERDUE_FLOOR_SECONDS, not their STARTUP_SECONDS
    job = _every_collective(tmp_path, "--steps", str(MIN_STEPS + 2), "--hang-rank", "1")
    try:
        def hung() -> dict | None:
            return next((r for r in _records(tmp_path, 0) if r["kind"] == "progress"
                         and (r.get("collective") or {}).get("op") == "all_gather"), None)

        progress = wait_until(hung, timeout=120, what="rank 0's progress record inside the all-gather's wait")
    finally:
        foreign._stop(job)
    assert progress["phase"] == "collective" and progress["step"] == MIN_STEPS + 1  # the last step that ended
    assert (progress["collective"]["group"], progress["collective"]["group_size"]) == ("default", 2)


# -- layout from a device mesh -------------------------------------------------------------------------------------

def _mesh(names: tuple[str, ...] | None, shape: tuple[int, ...], coordinate: list[int]) -> SimpleNamespace:
    """What detect_layout reads of a DeviceMesh (its public `mesh`, `mesh_dim_names`, `get_coordinate()`)."""
    return SimpleNamespace(mesh=torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names,
                           get_coordinate=lambda: coordinate)


def test_every_pipeline_schedule_torch_exports_has_its_label_and_a_known_bubble_or_none():
    """The hello's `schedule` of each of torch.distributed.pipelining's public schedules (a new one fails here, not
    silently named by its class), and the planner's bubble for it where one is modelled."""
    from torch.distributed.pipelining import schedules

    classes = {name: getattr(schedules, name) for name in dir(schedules) if name.startswith("Schedule")}
    public = {name for name, cls in classes.items()
              if isinstance(cls, type) and issubclass(cls, schedules._PipelineSchedule)}
    assert public <= set(pipelining.SCHEDULE_LABELS), public - set(pipelining.SCHEDULE_LABELS)
    assert {"ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble"} <= public
    shape = pipelining.PipelineShape(schedule="interleaved_1f1b", stages=4, ranks=2, rank=0, micro_batches=4,
                                     virtual_stages=2, group=None, modules=())
    assert shape.bubble_theoretical == 1 / 9  # (p-1)/(v·m+p-1)
    assert dataclasses.replace(shape, schedule="dualpipev").bubble_theoretical is None


def test_a_stage_names_its_layers_one_level_into_its_containers():
    """torchtitan's stage modules: `layers` is a ModuleDict whose remaining keys are the stage's layers."""
    model = torch.nn.Module()
    model.tok_embeddings = torch.nn.Embedding(4, 2)
    model.layers = torch.nn.ModuleDict({"2": torch.nn.Linear(2, 2), "3": torch.nn.Linear(2, 2)})
    model.norm = torch.nn.LayerNorm(2)
    assert list(pipelining.module_names(model)) == ["tok_embeddings", "layers.2", "layers.3", "norm"]


@pytest.mark.integration
def test_the_jobs_own_forward_pre_hooks_are_the_models_compute(tmp_path):
    """A job's pre-hook on its model (FSDP2's all-gather, a TP plan's input preparation, a user's own), registered
    before gpuwatch's, runs after it: its 0.2 s a step is compute, not outside the model. One rank, gloo."""
    job = tmp_path / "job.py"
    job.write_text(
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method=f'file://{os.environ[\"STORE\"]}', rank=0, world_size=1)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "model.register_forward_pre_hook(lambda module, inputs: time.sleep(0.2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    model(torch.ones(2, 4)).sum().backward()\n"
        "    optimizer.step()\n"
        "dist.destroy_process_group()\n")
    env = {**instrumented_environment(os.environ, new_job="pre-hook", run_log=str(tmp_path / "log")),
           "STORE": str(tmp_path / "store")}
    env.pop("GPUWATCH_RUN_STATUS", None)
    result = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [record for line in (tmp_path / "log" / "rank-00000.jsonl").read_text().splitlines()
             if (record := json.loads(line))["kind"] == "step"]
    assert len(steps) == 3
    for step in steps:
        assert step["compute_seconds"] >= 0.2 > step["outside_model_seconds"], step


def test_fsdp2s_default_mesh_without_names_over_the_world_is_data_parallel(monkeypatch):
    monkeypatch.setattr(layout_module.dist, "get_backend", lambda group=None: "gloo")
    found = layout_module._from_mesh(_mesh(None, (4,), [2]), 2, 4, 0)
    assert found is not None
    assert (found.tp_size, found.pp_size, found.dp_size, found.dp_rank) == (1, 1, 4, 2)
    assert found.process_groups["dp"] == (0, 1, 2, 3)
    assert layout_module._from_mesh(_mesh(None, (2, 2), [0, 1]), 1, 4, 0) is None  # 2-D, no names: cannot say


def test_a_mesh_that_is_no_layout_is_a_note_in_the_hello_not_a_silent_unknown(monkeypatch):
    monkeypatch.setattr(layout_module.dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(layout_module.dist, "get_rank", lambda group=None: 0)
    notes: list[str] = []
    with_cp = _mesh(("dp_shard", "cp", "tp"), (2, 2, 2), [0, 0, 0])
    found = layout_module.detect_layout(torch.nn.Linear(1, 1), [with_cp], environ={}, modules={}, notes=notes)
    assert found == (None, "unknown")
    assert notes == ["a device mesh over the 8 ranks with dimensions (dp_shard=2, cp=2, tp=2) is no tp × pp × dp "
                     "layout: layout unknown (give gpuwatch run --layout)"]
