"""The training loss (``training/cross_entropy.py``): F.cross_entropy's value bit for bit, its
gradient to float32 rounding, and two ``[N, V]`` tensors fewer at the backward's start."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from llmforge.events import IGNORE_INDEX
from llmforge.training.cross_entropy import cross_entropy_sum


def _loss_and_grad(fn, logits, labels, scale=0.37):
    z = logits.detach().clone().requires_grad_()
    loss = fn(z, labels)
    (loss * scale).backward()
    return loss.detach(), z.grad


def _reference(z, labels):
    return F.cross_entropy(z.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_value_bit_for_bit_and_gradient_within_rounding(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(96, 211)).to(dtype)
    labels = torch.randint(0, 211, (96,))
    labels[::7] = IGNORE_INDEX
    loss, grad = _loss_and_grad(cross_entropy_sum, logits, labels)
    ref_loss, ref_grad = _loss_and_grad(_reference, logits, labels)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss, ref_loss)  # the same nll_loss reduction
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-7 if dtype == torch.float32 else 0)
    assert grad[::7].abs().sum() == 0  # ignored rows get no gradient


def test_all_targets_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(5, 11)
    labels = torch.full((5,), IGNORE_INDEX)
    loss, grad = _loss_and_grad(cross_entropy_sum, logits, labels)
    assert loss.item() == 0.0 and grad.abs().sum() == 0


def test_ignored_rows_stay_zero_under_a_non_finite_upstream_gradient():
    z = torch.randn(4, 9, requires_grad=True)
    loss = cross_entropy_sum(z, torch.tensor([1, IGNORE_INDEX, 3, IGNORE_INDEX]))
    (loss * float("nan")).backward()
    assert z.grad[[1, 3]].abs().sum() == 0 and z.grad[[0, 2]].isnan().all()


def test_a_second_backward_through_the_loss_is_refused():
    z = torch.randn(4, 9, requires_grad=True)
    loss = cross_entropy_sum(z, torch.tensor([1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice through the same loss"):
        loss.backward()


def test_the_backward_makes_no_vocabulary_sized_tensor():
    """Peak over the loss's forward and backward: the standard loss holds the log-probabilities,
    the gradient of the log-probabilities and the logits' gradient at once (3 x 4 V bytes per
    row besides the logits); this one the log-probabilities, which become the gradient."""
    n, v = 256, 4096
    plane = n * v * 4

    def peak(fn):
        z = torch.randn(n, v, requires_grad=True)
        labels = torch.randint(0, v, (n,))
        tracker = MemTracker()
        tracker.track_external(z)
        with tracker:
            h = z * 1.0  # the logits, as the head makes them, dropped before the backward
            loss = fn(h, labels)
            del h
            loss.backward()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    lean, standard = peak(cross_entropy_sum), peak(_reference)
    assert standard - lean >= 0.9 * plane, (lean / plane, standard / plane)
    assert lean <= 3.2 * plane  # z and its gradient, and the logits with the log-probabilities


def test_compiled_code_uses_the_standard_loss():
    """Inside torch.compile the function is F.cross_entropy (inductor fuses it itself): the same
    gradient bit for bit, and a retained graph may run its backward twice, which the lean
    path refuses."""
    torch.manual_seed(1)
    logits, labels = torch.randn(16, 33), torch.randint(0, 33, (16,))
    compiled = torch.compile(cross_entropy_sum, backend="eager", fullgraph=True)
    loss, grad = _loss_and_grad(compiled, logits, labels)
    ref_loss, ref_grad = _loss_and_grad(_reference, logits, labels)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    z = logits.clone().requires_grad_()
    twice = compiled(z, labels)
    twice.backward(retain_graph=True)
    twice.backward()
    torch.testing.assert_close(z.grad, 2 * ref_grad / 0.37)


def test_dtensor_logits_use_the_standard_loss(tmp_path):
    """DTensor logits (a custom model's vocabulary-parallel output) take F.cross_entropy: its
    value and gradient, and a retained graph backs twice (the lean path would refuse). A real
    one-rank gloo group in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    torch.manual_seed(2)
    logits, labels = torch.randn(12, 17), torch.randint(0, 17, (12,))
    labels[3] = IGNORE_INDEX
    ref_loss, ref_grad = _loss_and_grad(_reference, logits, labels, scale=1.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        z = distribute_tensor(logits.clone(), mesh, [Replicate()]).requires_grad_()
        loss = cross_entropy_sum(z, distribute_tensor(labels, mesh, [Replicate()]))
        assert isinstance(loss, DTensor)
        loss.backward(retain_graph=True)
        loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss)
        torch.testing.assert_close(z.grad.full_tensor(), 2 * ref_grad)
    finally:
        dist.destroy_process_group()
