"""The Triton launchers check every tensor argument (device, dtype, shape) and name the bad one,
instead of handing the kernel a pointer of the wrong type or on the wrong device. On this CPU
machine a ``meta`` tensor stands for "another device"."""
import dataclasses

import pytest
import torch

from conftest import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs CUDA or TRITON_INTERPRET=1")

B, T, V = 2, 3, 50


def _forward_args():
    gen = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B, T, V, generator=gen), labels=torch.randint(0, V, (B, T), generator=gen))


def _backward_args():
    from aepo_kernels.triton_kernels import triton_forward

    args = _forward_args()
    _, _, lse, eu = triton_forward(args["logits"], args["labels"], 1.0, -100)
    return dict(**args, lse=lse, eu=eu, g_lp=torch.ones(B, T), g_h=torch.ones(B, T),
                out=torch.empty(B, T, V))


def _one_pass_args():
    from aepo_kernels.row_inputs import RowInputs

    args = _forward_args()
    inputs = RowInputs(torch.zeros(B, T), torch.ones(B, T), torch.full((B, T), 1 / 6), torch.tensor(1.0),
                       torch.tensor(0.5), torch.zeros(B, T))
    return dict(**args, inputs=inputs, out=torch.empty(B, T, V))


def _call(kind: str, args: dict):
    from aepo_kernels import LossConfig
    from aepo_kernels.triton_kernels import triton_backward, triton_forward, triton_one_pass

    if kind == "forward":
        return triton_forward(args["logits"], args["labels"], 1.0, -100)
    if kind == "backward":
        return triton_backward(args["logits"], args["labels"], args["lse"], args["eu"], args["g_lp"], args["g_h"],
                               1.0, -100, args["out"])
    return triton_one_pass(args["logits"], args["labels"], args["inputs"], LossConfig(), 1.0, -100, args["out"])


def _replace(kind: str, name: str, make):
    """The valid arguments of ``kind`` with ``name`` replaced by ``make(old)``."""
    args = {"forward": _forward_args, "backward": _backward_args, "one_pass": _one_pass_args}[kind]()
    if name in args:
        args[name] = make(args[name])
    else:  # a field of the one-pass RowInputs
        args["inputs"] = dataclasses.replace(args["inputs"], **{name: make(getattr(args["inputs"], name))})
    return args


ARGUMENTS = ([("forward", n) for n in ("labels",)]
             + [("backward", n) for n in ("labels", "lse", "eu", "g_lp", "g_h", "out")]
             + [("one_pass", n) for n in ("labels", "out", "old_logprobs", "advantages", "weight", "ref_logprobs",
                                          "entropy_mean", "entropy_std")])


@pytest.mark.parametrize("kind", ["forward", "backward", "one_pass"])
def test_valid_arguments_run(kind):
    _call(kind, _replace(kind, "labels", lambda t: t))


@pytest.mark.parametrize("kind,name", ARGUMENTS)
def test_every_tensor_argument_on_another_device_is_named(kind, name):
    args = _replace(kind, name, lambda t: t.to("meta"))
    with pytest.raises(ValueError, match=f"{name} is on meta, the logits on cpu"):
        _call(kind, args)


WRONG_DTYPE = {"labels": torch.int32, "lse": torch.float64, "eu": torch.bfloat16, "g_lp": torch.float16,
               "g_h": torch.float64, "out": torch.bfloat16, "old_logprobs": torch.int64, "advantages": torch.bool,
               "weight": torch.int32, "ref_logprobs": torch.int64, "entropy_mean": torch.int64,
               "entropy_std": torch.int32}


@pytest.mark.parametrize("kind,name", ARGUMENTS)
def test_every_tensor_argument_of_the_wrong_dtype_is_named(kind, name):
    args = _replace(kind, name, lambda t: t.to(WRONG_DTYPE[name]))
    with pytest.raises(TypeError, match=name):
        _call(kind, args)


@pytest.mark.parametrize("kind,name", [("forward", "labels"), ("backward", "lse"), ("backward", "out"),
                                       ("one_pass", "old_logprobs"), ("one_pass", "entropy_std")])
def test_wrong_shapes_are_named(kind, name):
    args = _replace(kind, name, lambda t: torch.cat([t.reshape(-1), t.reshape(-1)]))
    with pytest.raises(TypeError, match=name):
        _call(kind, args)


def test_logits_dtype_and_layout():
    from aepo_kernels.triton_kernels import triton_forward

    labels = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(TypeError, match="logits dtype torch.float64"):
        triton_forward(torch.zeros(B, T, V, dtype=torch.float64), labels, 1.0, -100)
    with pytest.raises(ValueError, match="unit stride on the vocab dim"):
        triton_forward(torch.zeros(B, V, T).transpose(1, 2), labels, 1.0, -100)
