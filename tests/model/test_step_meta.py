"""The CPU step's seam: one attention backend chosen at load (kernels/backends.py), the step's row
bookkeeping built once per step by the runner (kernels/step.py) and read by every layer."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu as cpu_ext

BUILD = cpu_ext.current()[0]    # the build under test here (None: torch's operators)


def _runner(model_dir, cpu_kernels, model_impl="auto"):
    from handler.model.runner import ModelRunner
    r = ModelRunner(model_dir, dtype="fp32", device="cpu", block_size=4, kv_cache_tokens=256, max_running=8,
                    cpu_kernels=cpu_kernels, model_impl=model_impl)
    r.prepack_cpu()
    if r.own:
        r.model.decode_stack = None     # the layers one by one (the stack reads the plan once for all)
    return r


@pytest.fixture(autouse=True)
def _back_to_the_default_build():
    """A runner selects its build for the whole process: put the default back afterwards."""
    yield
    cpu_ext.select(None)


def _steps():
    """Two prompts, a mixed step (two decode rows and a third prompt), a chunk after cached rows
    beside a decode row, then two decode-only steps."""
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(max_new_tokens=8)
    a, b, c, d = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 5, 7, 12))
    ta, tb, tc, td = [0, 1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12, 13]
    return [
        [StepItem(1, a, 0, ta, True, p, a), StepItem(2, b, 0, tb, True, p, b)],
        [StepItem(1, [17], 9, ta, True, p, a + [17]), StepItem(2, [23], 5, tb, True, p, b + [23]),
         StepItem(3, c, 0, tc, True, p, c)],
        [StepItem(4, d[:5], 0, td, False, p, d)],
        [StepItem(4, d[5:], 5, td, True, p, d), StepItem(1, [4], 10, ta, True, p, a + [17, 4])],
        [StepItem(1, [5], 11, ta, True, p, []), StepItem(2, [6], 6, tb, True, p, []),
         StepItem(3, [7], 7, tc, True, p, [])],
        [StepItem(1, [8], 12, ta, True, p, []), StepItem(3, [9], 8, tc, True, p, [])],
    ]


def _record(runner, monkeypatch):
    """Count plan_step calls and note, per step, the plan object each layer's attention read."""
    from handler.model import runner as runner_mod
    made, seen = [], []
    real_plan = runner_mod.plan_step
    monkeypatch.setattr(runner_mod, "plan_step", lambda *a, **k: made.append(real_plan(*a, **k)) or made[-1])
    real_forward = runner.attention.forward
    monkeypatch.setattr(runner.attention, "forward",
                        lambda *a, **k: seen.append(a[5].plan) or real_forward(*a, **k))
    return made, seen


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_the_runner_builds_the_plan_once_per_step_and_every_layer_reads_it(demo_model_factory, monkeypatch, impl):
    from handler.model.runner import pack_step
    r = _runner(demo_model_factory("llama"), BUILD or "torch", impl)
    assert r.own is (impl == "auto")
    made, seen = _record(r, monkeypatch)
    steps = _steps()
    for items in steps:
        r.forward(pack_step(items, 4)[0])
    n_layers = r.kv.num_layers
    assert len(made) == len(steps)
    assert len(seen) == n_layers * len(steps)
    for i, plan in enumerate(made):             # each step's layers read that step's one plan object
        assert all(p is plan for p in seen[i * n_layers:(i + 1) * n_layers]), i
    assert [p.all_decode for p in made] == [False, False, False, False, True, True]
    assert [p.prompts is not None for p in made] == [True, True, True, False, True, True]


def test_one_backend_is_chosen_at_load_and_named_in_the_log(demo_model_factory, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        torch_runner = _runner(demo_model_factory("llama"), "torch")
    assert type(torch_runner.attention) is kernels.TorchAttention
    assert "attention: plain torch (kernels/torch_paged.py)" in caplog.text
    if BUILD is None:
        pytest.skip("no C kernel build on this host (LMI_CPU_KERNELS=torch or no compiler): the torch backend only")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        c_runner = _runner(demo_model_factory("llama"), BUILD)
    assert type(c_runner.attention) is kernels.CpuAttention and c_runner.attention.name == BUILD
    assert f"attention: C kernels, {BUILD}" in caplog.text


def test_the_c_and_torch_backends_agree_on_every_kind_of_step(demo_model_factory):
    # The same steps through the C kernels and through plain torch (each with its own GEMMs):
    # fp32 logits within summation-order noise.
    if BUILD is None:
        pytest.skip("no C kernel build on this host (LMI_CPU_KERNELS=torch or no compiler)")
    from handler.model.runner import pack_step
    path = demo_model_factory("llama")
    c_runner = _runner(path, BUILD)
    c = [c_runner.forward(pack_step(items, 4)[0]).clone() for items in _steps()]
    t_runner = _runner(path, "torch")
    t = [t_runner.forward(pack_step(items, 4)[0]).clone() for items in _steps()]
    for x, y in zip(c, t):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() <= 1e-3 * max(1.0, y.abs().max().item())
