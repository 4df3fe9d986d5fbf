"""dvi.features and the features a request's records carry: encodings against the values they encode, a request's
capture with recomputed positions and holes, the share of requests that carry them, the record's wire form and its
checks, and dvi's engine capturing exactly the target's aux hidden states (`dvi.eagle3.target_features`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from dvi.config import SpecConfig, load_config
from dvi.eagle3 import target_features
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import RecordError
from dvi.features import Captured, Features, carries
from dvi.record_codec import Limits, decode, encode
from dvi.records import Sampling, from_dict, records_from_result, validate

VOCAB = 97
LAYERS = (0, 1, 2)
pytestmark = pytest.mark.usefixtures("one_thread")


def rows(n: int, width: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.linspace(0.1, 30.0, width)  # channels of very different scales
    return x.to(torch.bfloat16)


def test_bf16_is_exact_and_int8_is_within_half_a_step_of_each_layers_scale():
    x = rows(7)
    bf16 = Features.encode(x, LAYERS, 3, "bf16")
    assert bf16.data.dtype == np.uint16 and bf16.scales is None and torch.equal(bf16.tensor(), x)
    assert (bf16.rows, bf16.width, bf16.start, bf16.end, bf16.nbytes) == (7, 96, 3, 10, 7 * 96 * 2)
    q = Features.encode(x, LAYERS, 3, "int8")
    assert q.data.dtype == np.int8 and q.scales.shape == (7, 3) and q.nbytes == 7 * 96 + 7 * 3 * 4
    err = (q.tensor().float() - x.float()).reshape(7, 3, 32).abs()
    step = torch.from_numpy(q.scales)[..., None]
    assert (err <= 0.5 * step + 0.01 * x.float().abs().reshape(7, 3, 32) + 1e-6).all()  # bf16 rounding of the result
    zero = Features.encode(torch.zeros(2, 96), LAYERS, 0, "int8")
    assert torch.equal(zero.tensor(), torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="encoding"):
        Features.encode(x, LAYERS, 0, "fp8")


def test_windows_and_finiteness():
    f = Features.encode(rows(10), LAYERS, 5, "int8")
    w = f.window(8, 12)
    assert (w.start, w.rows) == (8, 4) and torch.equal(w.tensor(), f.tensor()[3:7])
    assert f.window(0, 5) is None and f.last(0) is None and f.last(3).start == 12
    assert f.finite()
    bad = rows(3)
    bad[1, 4] = float("nan")
    assert not Features.encode(bad, LAYERS, 0, "bf16").finite()


def test_captured_keeps_the_latest_rows_and_the_run_without_holes_ending_at_the_last_fed_position():
    c = Captured()
    x = rows(12)
    c.add(0, x[:5], LAYERS)  # a prefill
    c.add(5, x[5:7], LAYERS)
    c.add(0, x[:7] * 2, LAYERS)  # the request recomputed after a preemption
    c.add(7, x[7:9], LAYERS)
    got, start, counts = c.assemble(9)
    assert start == 0 and torch.equal(got, torch.cat([x[:7] * 2, x[7:9]])) and counts == {"recomputed": 7, "missing": 0}
    holey = Captured()
    holey.add(4, x[4:9], LAYERS)  # positions 0..3 served from a prefix cache: never computed
    got, start, counts = holey.assemble(9)
    assert start == 4 and torch.equal(got, x[4:9]) and counts["missing"] == 4
    assert holey.assemble(10)[0] is None  # the last fed position has no row
    swapped = Captured()
    swapped.add(0, x[:4], LAYERS)
    swapped.add(4, x[4:6, :64], (0, 1))  # a drafter reading other layers: the earlier rows go
    got, start, _ = swapped.assemble(6)
    assert start == 4 and got.shape == (2, 64)


def test_the_share_of_requests_carrying_features_is_a_fixed_function_of_the_request_id():
    ids = [f"req-{i}" for i in range(4000)]
    half = [carries(i, 0.5) for i in ids]
    assert half == [carries(i, 0.5) for i in ids] and 0.45 < sum(half) / len(ids) < 0.55
    assert all(carries(i, 1.0) for i in ids[:50]) and not any(carries(i, 0.0) for i in ids[:50])
    assert all(carries(i, 0.5) for i, h in zip(ids, half) if h and carries(i, 0.3))  # nested shares


def feature_result(tiny_target, encoding_rows: int | None = None, features_layers=LAYERS, **request):
    engine = SpeculativeEngine(tiny_target, None, SpecConfig(k=4, adaptive=False, topk_logprobs=8),
                               features_layers=features_layers)
    req = Request([1, 2, 3, 4, 5, 6], max_new_tokens=30, **request)
    return req, engine.generate([req])[0]


def test_dvis_engine_keeps_the_targets_aux_hidden_states_of_every_token_it_fed(tiny_target, tiny_drafter):
    for drafter in (None, tiny_drafter):
        engine = SpeculativeEngine(tiny_target, drafter, SpecConfig(k=3, adaptive=False, topk_logprobs=8),
                                   features_layers=(2, 0), max_batch=2)
        reqs = [Request([1, 2, 3, 4, 5, 6], max_new_tokens=20), Request([9, 8], max_new_tokens=14, temperature=0.9, seed=1)]
        for req, res in zip(reqs, engine.generate(reqs)):
            seq = torch.tensor([req.prompt_ids + res.token_ids])
            want = target_features(tiny_target, seq[:, :-1], (0, 2))[0]  # the last token is never fed
            assert res.features_layers == (0, 2) and res.features_start == 0
            torch.testing.assert_close(res.features.float(), want.float(), rtol=1e-4, atol=1e-4)
    plain = SpeculativeEngine(tiny_target, None, SpecConfig(k=3, adaptive=False)).generate([Request([1, 2], max_new_tokens=4)])
    assert plain[0].features is None  # no layers asked for, no EAGLE-3 drafter: none kept


def test_records_carry_the_last_positions_of_each_chunk_in_the_chosen_encoding(tiny_target):
    req, res = feature_result(tiny_target)
    length = len(req.prompt_ids) + len(res.token_ids)
    recs = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req, chunk_rounds=7,
                               features_max_tokens=12)
    assert len(recs) > 2
    for r in recs:
        validate(r, VOCAB)
        f = r.features
        assert f.end == r.length - (1 if r.final else 0) or f.end == min(r.length, length - 1)
        assert f.rows == min(12, f.end) and f.layers == LAYERS and f.encoding == "bf16"
        torch.testing.assert_close(f.tensor(), res.features[f.start : f.end].to(torch.bfloat16))
        back = decode(encode(r, logprob_dtype="float32"), VOCAB)
        assert back == r and back.features == f
        assert from_dict(r.to_dict(), VOCAB).features == f  # the JSON-lines form rounds log-probs, not features
    q = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req, features_encoding="int8")
    assert q[0].features.encoding == "int8" and decode(encode(q[0], logprob_dtype="float32"), VOCAB) == q[0]
    none = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req, features_share=0.0)
    assert all(r.features is None for r in none)


def test_a_record_too_large_for_its_bound_drops_its_oldest_feature_rows(tiny_target):
    req, res = feature_result(tiny_target)
    r = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req)[0]
    full = encode(r)
    bound = len(full) - 10 * r.features.row_bytes
    trimmed = decode(encode(r, max_bytes=bound), VOCAB)
    assert len(encode(r, max_bytes=bound)) <= bound
    assert trimmed.features.end == r.features.end and trimmed.features.rows <= r.features.rows - 10
    assert decode(encode(r, max_bytes=len(full) - r.features.nbytes + 10), VOCAB).features is None
    limits = Limits(topk=8, max_rounds=64, max_k=8, max_feature_bytes=100)
    with pytest.raises(RecordError, match="bytes of features"):
        decode(full, VOCAB, limits=limits)
    # the trainer's limits (dvi train) take a record's features up to the record's own bound
    trainers = Limits(topk=8, max_rounds=64, max_k=8, max_feature_bytes=load_config([]).stream.max_record_bytes)
    assert decode(full, VOCAB, limits=trainers).features == r.features


@pytest.mark.parametrize("breakage, field", [
    (lambda f: setattr(f, "start", 10_000), "features.start"),
    (lambda f: setattr(f, "layers", (2, 1, 0)), "features.layers"),
    (lambda f: setattr(f, "encoding", "fp8"), "features.encoding"),
    (lambda f: setattr(f, "data", f.data[:, :95]), "features.width"),
    (lambda f: f.data.__setitem__((0, 0), 0x7FC0), "features.data"),  # a bf16 NaN
])
def test_malformed_features_are_refused_naming_the_field(tiny_target, breakage, field):
    req, res = feature_result(tiny_target)
    r = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req)[0]
    r.features.data = r.features.data.copy()
    breakage(r.features)
    with pytest.raises(RecordError) as e:
        validate(r, VOCAB)
    assert e.value.field == field


def test_a_reader_without_features_and_a_record_without_them(tiny_target):
    req, res = feature_result(tiny_target, features_layers=None)
    r = records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=Sampling(0.0))[0]
    assert r.features is None and decode(encode(r), VOCAB).features is None
    req, res = feature_result(tiny_target)
    old = copy.deepcopy(records_from_result(res, replica_id="r", target_name="tiny", vocab_size=VOCAB, sampling=req)[0])
    from dvi.record_proto import message_class

    m = message_class()()
    data = encode(old)
    m.ParseFromString(data[6:])
    assert m.features_width == 96 and list(m.features_layers) == list(LAYERS)
