"""The checking scans in kernels/scans.py equal a plain per-token recurrence and HF's own scan functions."""
import pytest
import torch
from conftest import relative_error
from transformers.models.mamba import modeling_mamba
from transformers.models.mamba2 import modeling_mamba2

from mamba_captum.kernels import scans


def recurrence(x, decay, inputs, readout):
    """h_t = decay_t ∘ h_{t-1} + inputs_t, y_t = readout(h_t, t): the textbook loop."""
    state, out = torch.zeros_like(inputs[:, 0]), []
    for t in range(x.shape[1]):
        state = decay[:, t] * state + inputs[:, t]
        out.append(readout(state, t))
    return torch.stack(out, 1)


@pytest.mark.parametrize("length", [1, 7, 300])
def test_selective_scan_matches_recurrence_and_hf(length, monkeypatch):
    monkeypatch.setattr(scans, "SELECTIVE_TOKENS_PER_BLOCK", 64)  # several blocks at L = 300
    b, d, n = 2, 5, 3
    u, delta = torch.randn(b, length, d, dtype=torch.float64), torch.rand(b, length, d, dtype=torch.float64) * 2
    A = -torch.rand(d, n, dtype=torch.float64) * 8
    B, C = torch.randn(b, length, n, dtype=torch.float64), torch.randn(b, length, n, dtype=torch.float64)
    got = scans.selective_scan_reference(u, delta, A, B, C)
    decay = torch.exp(delta[..., None] * A)
    inputs = (delta * u)[..., None] * B[:, :, None, :]
    expected = recurrence(u, decay, inputs, lambda h, t: (h * C[:, t, None, :]).sum(-1))
    assert relative_error(got, expected) < 1e-12
    hf = modeling_mamba.mamba_selective_scan(u.transpose(1, 2), delta.transpose(1, 2), A, B.transpose(1, 2),
                                             C.transpose(1, 2))
    assert relative_error(got, hf.transpose(1, 2)) < 1e-6  # HF computes in float32


@pytest.mark.parametrize("length,chunk", [(1, 4), (13, 4), (64, 64), (70, 16)])
def test_ssd_scan_matches_recurrence_and_hf(length, chunk):
    b, h, p, g, n = 2, 4, 3, 2, 5
    x, delta = torch.randn(b, length, h, p, dtype=torch.float64), torch.rand(b, length, h, dtype=torch.float64) * 3
    A = -torch.rand(h, dtype=torch.float64) * 10
    B, C = torch.randn(b, length, g, n, dtype=torch.float64), torch.randn(b, length, g, n, dtype=torch.float64)
    got = scans.ssd_scan_reference(x, delta, A, B, C, chunk=chunk)
    Bh, Ch = B.repeat_interleave(h // g, 2), C.repeat_interleave(h // g, 2)
    decay = torch.exp(delta * A)[..., None, None]
    inputs = (delta[..., None] * x)[..., None] * Bh[:, :, :, None, :]
    expected = recurrence(x, decay, inputs, lambda s, t: (s * Ch[:, t, :, None, :]).sum(-1))
    assert relative_error(got, expected) < 1e-12
    hf = modeling_mamba2.mamba2_chunk_scan(x, delta, A, B, C, chunk_size=chunk)
    assert relative_error(got, hf) < 1e-6  # HF computes in float32
