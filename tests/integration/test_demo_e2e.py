"""The disaggregated demo: decode from moved KV gives exactly a single-process run's tokens.

First in one process (the KV only goes through entry bytes), then across two
kvstore-server nodes (network namespaces where allowed, else loopback ports),
then the demo itself as a subprocess.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.layout import pack_hf, unpack_hf
from tools import model as demo_model

# Shorter than a block, exactly one block, not a multiple of it, several blocks.
LENGTHS = [1, 7, 16, 33, 100]
DECODE = 12


@pytest.fixture(scope="module")
def model():
    demo_model.configure_torch(1)
    return demo_model.build_model()


@pytest.fixture(scope="module")
def layout(model):
    return demo_model.kv_layout(model)


def _prompt(model, length, seed=0):
    return demo_model.make_prompt(length, seed, model.config.vocab_size)


# ------------------------------------------------------------ single process
def test_model_is_a_pure_function_of_its_seed(model):
    again = demo_model.build_model()
    other = demo_model.build_model(seed=demo_model.DEFAULT_SEED + 1)
    for (name, w), w2, w3 in zip(model.state_dict().items(), again.state_dict().values(),
                                 other.state_dict().values()):
        assert torch.equal(w, w2), name
    assert not all(torch.equal(w, w3) for w, w3 in zip(again.parameters(), other.parameters()))


@pytest.mark.parametrize("length", LENGTHS)
def test_decode_from_entry_bytes_matches_generate(model, layout, length):
    tokens = _prompt(model, length)
    reference = demo_model.reference_tokens(model, tokens, DECODE)
    result = demo_model.prefill(model, tokens)
    assert [k.shape for k, _ in result.past] == [(1, layout.kv_heads, length, layout.head_dim)] * 4
    data = pack_hf(layout, result.past)
    assert data.numel() == layout.nbytes(length)
    past = unpack_hf(layout, data.clone(), length)  # a copy: nothing shared with prefill
    first = demo_model.token_from_hidden(model, result.hidden)
    assert first == result.next_token == reference[0]
    assert [first, *demo_model.decode_greedy(model, past, first, DECODE)] == reference


def test_tokens_depend_on_the_kv(model, layout):
    """The identical-tokens check can fail: wrong or damaged KV changes the output."""
    tokens = _prompt(model, 40)
    reference = demo_model.reference_tokens(model, tokens, DECODE)
    result = demo_model.prefill(model, tokens)
    other = demo_model.prefill(model, _prompt(model, 40, seed=7))
    wrong = [reference[0], *demo_model.decode_greedy(model, other.past, reference[0], DECODE)]
    assert wrong != reference
    data = pack_hf(layout, result.past)
    data[: layout.block_nbytes] = 0  # lose the first block's KV
    damaged = unpack_hf(layout, data, 40)
    assert [reference[0], *demo_model.decode_greedy(model, damaged, reference[0], DECODE)] != reference


def test_decode_leaves_the_callers_kv_alone(model):
    result = demo_model.prefill(model, _prompt(model, 20))
    before = [(k.clone(), v.clone()) for k, v in result.past]
    demo_model.decode_greedy(model, result.past, result.next_token, 4)
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(result.past, before))
    assert result.past[0][0].shape[2] == 20


def test_prompts_are_deterministic_and_in_vocab(model):
    vocab = model.config.vocab_size
    assert _prompt(model, 300) == _prompt(model, 300)
    assert _prompt(model, 300) != _prompt(model, 300, seed=1)
    assert all(0 <= t < vocab for t in _prompt(model, 300))
    with pytest.raises(ValueError):
        demo_model.make_prompt(0, 0, vocab)
