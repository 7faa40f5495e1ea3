"""A store filled under torch.inference_mode() keeps working outside it (generate() after a
prefill run under inference_mode is the common case)."""
import torch

from tests.store.conftest import make_store


def test_append_outside_inference_mode_after_prefill_inside(tmp_path):
    store = make_store(tmp_path, block_tokens=4, hot_tokens=16, attention="sparse")  # digests kept
    seq = store.add_sequence()
    k = torch.randn(2, 84, 8).half()
    with torch.inference_mode():
        store.append(seq, 0, k[:, :80], k[:, :80])   # grows the digest table inside inference mode
    store.append(seq, 0, k[:, 80:], k[:, 80:])       # seals a block outside it
    store.end_step()
    K, V = store.gather(seq, 0)
    assert torch.equal(K, k) and torch.equal(V, k)
    store.close()
