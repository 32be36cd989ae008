import pytest
import torch
from transformers import DynamicCache

from prodrl_pipeline.engine.kv_cache import GrowingLayer, growing_cache


@torch.inference_mode()
def _decode(model, cache, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy decoding one token per forward: each step's logits and the layer-0 buffer's address."""
    out = model(input_ids=prompt, cache=cache, use_cache=True)
    logits, addresses = [out.logits[:, -1]], [out.cache.layers[0].keys.data_ptr()]
    for _ in range(steps):
        ids = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=ids, cache=out.cache, use_cache=True)
        logits.append(out.logits[:, -1])
        addresses.append(out.cache.layers[0].keys.data_ptr())
    return logits, addresses


def test_a_growing_cache_decodes_bit_for_bit_as_the_dynamic_cache_and_reallocates_rarely(tiny_model):
    seeded = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tiny_model.config.vocab_size, (3, 9), generator=seeded)
    grown, addresses = _decode(tiny_model, growing_cache(), prompt, steps=60)
    reference, _ = _decode(tiny_model, DynamicCache(), prompt, steps=60)
    assert all(torch.equal(a, b) for a, b in zip(grown, reference, strict=True))
    reallocations = sum(a != b for a, b in zip(addresses, addresses[1:], strict=False))
    assert reallocations == 3  # capacity 9 (the prompt), then 20, 42, 86 (twice what is needed)


def test_stacking_selecting_and_cutting_keep_each_rows_positions():
    def layer(rows: int, length: int, fill: float) -> GrowingLayer:
        out = GrowingLayer()
        out.update(torch.full((rows, 1, length, 2), fill), torch.full((rows, 1, length, 2), -fill))
        return out

    a, b = layer(2, 3, 1.0), layer(1, 5, 2.0)
    a.update(torch.full((2, 1, 1, 2), 3.0), torch.full((2, 1, 1, 2), -3.0))  # grows a's buffer: 4 positions
    a.stack_below(b, 5)
    assert a.keys.shape == (3, 1, 5, 2)
    assert a.keys[:2, 0, :, 0].tolist() == [[0, 1, 1, 1, 3]] * 2  # left-padded to b's length
    assert a.values[2, 0, :, 0].tolist() == [-2.0] * 5
    a.batch_select_indices(torch.tensor([2]))
    a.cut_left(2)
    assert a.keys[:, 0, :, 0].tolist() == [[2.0, 2.0, 2.0]] and a.get_seq_length() == 3
    a.update(torch.full((1, 1, 1, 2), 4.0), torch.full((1, 1, 1, 2), -4.0))
    assert a.values[:, 0, :, 0].tolist() == [[-2.0, -2.0, -2.0, -4.0]]


def test_a_tensor_assigned_to_a_layer_is_refused_rather_than_emptying_it():
    layer = GrowingLayer()
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    for name in ("keys", "values"):
        with pytest.raises(TypeError, match="written through update"):
            setattr(layer, name, torch.zeros(1, 1, 1, 2))
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, torch.ones(1, 1, 3, 2))
