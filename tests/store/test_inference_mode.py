"""A store filled under torch.inference_mode() keeps working outside it (generate() after a
prefill run under inference_mode is the common case)."""
import torch

from tests.store.conftest import make_store


def test_append_outside_inference_mode_after_prefill_inside(tmp_path):
    store = make_store(tmp_path, block_tokens=4, device_tokens=16, attention="sparse")  # digests kept
    seq = store.add_sequence()
    k = torch.randn(2, 84, 8).half()
    with torch.inference_mode():
        store.append(seq, 0, k[:, :80], k[:, :80])   # grows the digest table inside inference mode
    store.append(seq, 0, k[:, 80:], k[:, 80:])       # seals a block outside it
    store.end_step()
    K, V = store.gather(seq, 0)
    assert torch.equal(K, k) and torch.equal(V, k)
    store.close()


def test_decode_into_open_block_opened_inside_inference_mode():
    """The open block's slot view is made when the block opens (here inside inference_mode);
    decode steps outside it write through that view."""
    store = make_store(None, block_tokens=4, device_tokens=16, host_bytes=1 << 20, attention="sparse")
    seq = store.add_sequence()
    k = torch.randn(2, 84, 8).half()
    with torch.inference_mode():
        store.append(seq, 0, k[:, :81], -k[:, :81])  # block 20 opens with one token
    for i in range(81, 84):
        store.append(seq, 0, k[:, i:i + 1], -k[:, i:i + 1])  # fills it token by token
    K, V = store.gather(seq, 0)
    assert torch.equal(K, k) and torch.equal(V, -k)
    store.close()
