"""research/rope.py, the rotary helpers of accuracy_sweep.py's simulated pre-RoPE key rows."""
import torch

from rope import rotate


def test_rotate_matches_transformers_and_inverts():
    """The rotary helpers: transformers' rotate_half convention at any start position, partial
    rotary dims passed through, the inverse undoing it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv = 1.0 / (100000 ** (torch.arange(0, 64, 2).float() / 64))
    x = torch.randn(3, 50, 64)
    for start in (0, 7, 4096):
        f = torch.arange(start, start + 50).float()[:, None] * inv[None]
        emb = torch.cat([f, f], -1)
        want, _ = apply_rotary_pos_emb(x[None], x[None], emb.cos()[None], emb.sin()[None])
        assert torch.allclose(rotate(x, start, inv), want[0], atol=1e-5)
        assert torch.allclose(rotate(rotate(x, start, inv), start, inv, inverse=True), x, atol=1e-5)
    part = rotate(x, 3, inv[:8])  # 16 of 64 dims rotated
    assert torch.equal(part[..., 16:], x[..., 16:]) and not torch.equal(part[..., :16], x[..., :16])
