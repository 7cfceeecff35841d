"""The consistency lab's gap, stacks, models and attribution, against independent oracles:
a hand-written float64 computation of the gap of a tiny model, identical stacks giving exactly
0, the built-in transformer's own ``apply`` (bit for bit), and full-sequence vs KV-cache
decoding in float32 (within float error)."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.consistency import (
    LM,
    FunctionLM,
    Runner,
    Stack,
    Taps,
    TransformerLM,
    attribute,
    gap_from_logits,
    logprob_gap,
    parse_stack,
)
from precisionlab.mixed import get_policy
from precisionlab.train import make_model

# --- the float64 oracle -------------------------------------------------------------------
V, D = 8, 4


def _tiny_params():
    """Embedding and head with values in [4, 8) and [2, 4): the logits are ~70, where a
    bfloat16 ulp is 0.5, so bf16 moves the log-probabilities by tenths of a nat; the bf16
    products and their sums are exact in float32 and float64."""
    rng = np.random.default_rng(3)
    emb = rng.uniform(4, 8, (V, D)).astype(np.float32)
    w = rng.uniform(2, 4, (D, V)).astype(np.float32)
    return {"emb": jnp.asarray(emb), "w": jnp.asarray(w)}


def _tiny_logits(params, tokens):
    return params["emb"][tokens] @ params["w"]


def _oracle(params, tokens):
    """delta, KL and flips by hand, in float64: the fp32 stack's logits as exact products
    (its float32 rounding is far below the gap), the bf16 stack's as the exact sum of the
    bf16-rounded operands' products rounded once to bfloat16."""
    emb = np.asarray(params["emb"], np.float64)
    w = np.asarray(params["w"], np.float64)
    bf = ml_dtypes.bfloat16
    emb16 = np.asarray(params["emb"]).astype(bf).astype(np.float64)
    w16 = np.asarray(params["w"]).astype(bf).astype(np.float64)
    tok = np.asarray(tokens)
    la = emb[tok] @ w
    lb = (emb16[tok] @ w16).astype(bf).astype(np.float64)

    def logp(x):
        m = x.max(-1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))

    pa, pb = logp(la)[:, :-1], logp(lb)[:, :-1]
    nxt = tok[:, 1:]
    rows, cols = np.meshgrid(np.arange(tok.shape[0]), np.arange(tok.shape[1] - 1), indexing="ij")
    delta = pa[rows, cols, nxt] - pb[rows, cols, nxt]
    kl = (np.exp(pa) * (pa - pb)).sum(-1)
    flips = pa.argmax(-1) != pb.argmax(-1)
    return delta, kl, flips


@pytest.fixture(scope="module")
def tiny():
    params = _tiny_params()
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, V, (6, 12)), jnp.int32)
    return params, tokens, _oracle(params, tokens)


@pytest.mark.parametrize("hardware", ["native", "h100-xla"])
def test_gap_against_a_float64_oracle(tiny, hardware):
    params, tokens, (delta, kl, flips) = tiny
    b = Stack(policy="bf16", hardware=hardware)
    g = logprob_gap(_tiny_logits, params, tokens, "fp32", b)
    assert g.delta.shape == delta.shape
    np.testing.assert_allclose(g.delta, delta, atol=1e-4, rtol=0)
    np.testing.assert_allclose(g.kl_tokens, kl, atol=1e-5, rtol=1e-3)
    assert np.array_equal(g.flips, flips)
    # the summaries, each from the oracle's deltas
    assert 0.05 < g.rms_nats  # the gap is real: tenths of a nat
    assert g.rms_nats == pytest.approx(np.sqrt(np.mean(delta**2)), abs=1e-4)
    assert g.mean_nats == pytest.approx(np.mean(delta), abs=1e-4)
    assert g.max_nats == pytest.approx(np.max(np.abs(delta)), abs=1e-4)
    lo, hi = math.log(0.8), math.log(1.2)
    near = np.minimum(np.abs(delta - lo), np.abs(delta - hi))
    assert near.min() > 1e-3  # the oracle's clip count cannot flip by float error
    assert 0 < g.clip_share == np.mean((delta < lo) | (delta > hi))
    assert g.kl == pytest.approx(np.mean(kl), rel=1e-3)
    assert g.flip_rate == np.mean(flips)
    s = g.summary()
    assert set(s) >= {"a", "b", "mean_nats", "rms_nats", "max_nats", "clip_share",
                      "flip_rate", "kl"}  # fmt: skip
    assert s["a"] == "fp32 native full" and "bf16" in s["b"]


def test_gap_from_logits_checks_its_inputs():
    tok = np.zeros((2, 3), np.int32)
    z = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="T >= 2"):
        gap_from_logits(np.zeros((2, 1), np.int32), z[:, :1], z[:, :1])
    with pytest.raises(ValueError, match="logits must both be"):
        gap_from_logits(tok, z, z[:, :2])
    with pytest.raises(ValueError, match="clip"):
        gap_from_logits(tok, z, z, clip=(1.1, 1.2))
    assert gap_from_logits(tok, z, z).rms_nats == 0.0


def test_nonfinite_logits_are_counted_not_hidden():
    tok = np.array([[0, 1, 2]])
    a = np.zeros((1, 3, 3))
    b = a.copy()
    b[0, 0, 1] = np.inf
    g = gap_from_logits(tok, a, b)
    assert g.nonfinite == 1 and "1 non-finite" in g.text()
    assert np.isfinite(g.rms_nats)


# --- stacks -------------------------------------------------------------------------------
def test_stack_parsing_and_errors():
    s = parse_stack("bf16")
    assert (s.format, s.hardware, s.mode, s.label) == ("bf16", "native", "full",
                                                        "bf16 native full")  # fmt: skip
    assert str(s.policy) == "p=f32,c=bf16,o=bf16"
    d = Stack(policy="fp16", hardware="h100-cublaslt", mode="decode", batch_size=4)
    assert d.label == "fp16 h100-cublaslt decode/4 kv16"
    assert parse_stack(d.to_dict()) == d
    assert parse_stack({"policy": "c=f16", "mode": "decode", "kv_block": None}).label == (
        "fp16 native decode kv-all"
    )
    # a policy other than the format's usual one is written out: two stacks, two labels
    assert Stack(policy="p=f32,c=f32,o=bf16").label == "p=f32,c=f32,o=bf16 native full"
    with pytest.raises(ValueError, match="ambiguous"):
        Stack(hardware="h100")
    with pytest.raises(ValueError, match=r"Stack\.hardware must be one of native"):
        Stack(hardware="tpu")
    with pytest.raises(ValueError, match=r"Stack\.mode"):
        Stack(mode="prefill")
    with pytest.raises(ValueError, match="batch_size"):
        Stack(batch_size=0)
    with pytest.raises(ValueError, match="unknown Stack field 'dtype'"):
        parse_stack({"dtype": "bf16"})
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_stack("bf17")
    with pytest.raises(TypeError, match="a stack is"):
        parse_stack(3)


def test_plain_functions_refuse_what_they_cannot_do(tiny):
    params, tokens, _ = tiny
    with pytest.raises(ValueError, match="mode='decode' needs a model with a KV cache"):
        logprob_gap(_tiny_logits, params, tokens, "fp32", Stack(mode="decode"))
    with pytest.raises(ValueError, match="lm_head_fp32 needs"):
        logprob_gap(_tiny_logits, params, tokens, "fp32", Stack(lm_head_fp32=True))
    with pytest.raises(ValueError, match="batch_size=4 must divide the 6 rows"):
        logprob_gap(_tiny_logits, params, tokens, "fp32", Stack(batch_size=4))

    def upcasting(p, t):  # computes in float32 whatever its params are
        return _tiny_logits(jax.tree.map(lambda x: x.astype(jnp.float32), p), t)

    with pytest.raises(ValueError, match="computes no value in bfloat16"):
        logprob_gap(upcasting, params, tokens, "fp32", "bf16")
    # under a GPU model the policy rounds every operation, so it runs (and differs)
    g = logprob_gap(upcasting, params, tokens, "fp32", Stack(policy="bf16", hardware="float32"))
    assert g.rms_nats > 0.05


class _TwoLayers(LM):
    """A model of one's own as an LM: an embedding and a head, both named layers."""

    layers = ("embed", "head")

    def forward(self, params, tokens, policy, taps: Taps):
        cd = policy.compute_dtype
        x = taps("embed", jnp.asarray(params["emb"]).astype(cd)[tokens])
        return taps("head", policy.cast_to_output(x @ jnp.asarray(params["out"]).astype(cd)))


def test_an_lm_of_ones_own_gets_the_options_checked_and_patched(tiny):
    params, tokens, _ = tiny
    lm = _TwoLayers()
    p = {"emb": params["emb"], "out": params["emb"].T}
    pol = get_policy("bf16")
    base, acts = lm.logits(p, tokens, pol, capture=True)
    assert set(acts) == {"embed", "head"} and np.array_equal(_bits(acts["head"]), _bits(base))
    # a patch whose flag is off changes no bit; on, the layer's output is replaced
    zero = jnp.zeros_like(acts["embed"])
    off = lm.logits(p, tokens, pol, patch={"embed": (jnp.bool_(False), zero)})
    on = lm.logits(p, tokens, pol, patch={"embed": (jnp.bool_(True), zero)})
    assert np.array_equal(_bits(off), _bits(base))
    assert not np.any(np.asarray(on, np.float32)) and np.any(np.asarray(base, np.float32))
    with pytest.raises(
        ValueError, match="cannot patch 'embd': _TwoLayers's layers are embed, head"
    ):
        lm.logits(p, tokens, pol, patch={"embd": (jnp.bool_(True), zero)})
    with pytest.raises(ValueError, match="_TwoLayers has no 'lm_head' layer"):
        lm.logits(p, tokens, pol, lm_head_fp32=True)
    with pytest.raises(ValueError, match="_TwoLayers has no KV-cache decoding"):
        lm.decode(p, None, tokens[:, 0], jnp.int32(0), pol)
    # the lab runs it: attribution patches each named layer; the head (bfloat16 in both
    # stacks, so a patch holds a's logits exactly) removes all of the gap
    att = attribute(lm, p, tokens, Stack(policy="p=f32,c=f32,o=bf16"), "bf16")
    assert [s.layer for s in att.layers] == ["embed", "head"]
    assert att.base.rms_nats > 0.05 and att.layers[-1].rms_nats == 0.0


# --- the built-in transformer ---------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    model = make_model("transformer", vocab_size=32, seq_len=8, d_model=16, depth=1, heads=2)
    params = model.init(jax.random.PRNGKey(1))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 32, (4, 8)), jnp.int32)
    return model, params, tokens, Runner(model, params)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def test_full_mode_is_the_models_own_apply_bit_for_bit(lm):
    model, params, tokens, runner = lm
    for fmt in ("bf16", "fp16"):  # float32: test_full_mode_matches_apply_with_the_models_options
        pol = get_policy(f"c={fmt}")
        want = jax.jit(lambda p, t, pol=pol: model.apply(p, t, pol))(params, tokens)
        got = runner.run(Stack(policy=fmt), tokens).logits
        assert got.dtype == want.dtype
        assert np.array_equal(_bits(got), _bits(want)), fmt


def test_full_mode_matches_apply_with_the_models_options():
    model = make_model("transformer", vocab_size=16, seq_len=4, d_model=8, depth=2, heads=2,
                       outlier_channels=2, high_precision=("block1",))  # fmt: skip
    params = model.init(jax.random.PRNGKey(2))
    tokens = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    for spec in ("c=f32", "c=bf16"):  # block1 runs in float32 (high_precision) under both
        pol = get_policy(spec)
        want = jax.jit(lambda p, t, pol=pol: model.apply(p, t, pol))(params, tokens)
        lm = TransformerLM(model)
        got = jax.jit(lambda p, t, pol=pol, lm=lm: lm.logits(p, t, pol))(params, tokens)
        assert np.array_equal(_bits(got), _bits(want)), spec


@pytest.mark.parametrize("kv_block", [None, 4])
def test_kv_cache_decoding_is_the_full_sequence_in_float32(lm, kv_block):
    _, _, tokens, runner = lm
    full = runner.run("fp32", tokens).logits
    dec = runner.run(Stack(mode="decode", kv_block=kv_block), tokens).logits
    assert dec.shape == full.shape
    np.testing.assert_allclose(dec, full, rtol=0, atol=2e-5 * np.abs(full).max())


def _zero_and_nonzero(lm, stacks, pairs):
    model, params, tokens, runner = lm
    for s in stacks:
        g = logprob_gap(model, params, tokens, s, s, runner=runner)
        assert not np.any(g.delta) and g.kl == 0.0 and g.flip_rate == 0.0, s.label
        assert g.rms_nats == g.max_nats == g.mean_nats == g.clip_share == 0.0
    return [logprob_gap(model, params, tokens, a, b, runner=runner) for a, b in pairs]


def test_identical_stacks_give_exactly_zero_and_different_ones_do_not(lm):
    dec = Stack(policy="bf16", mode="decode", batch_size=2, kv_block=2)
    (g,) = _zero_and_nonzero(lm, [dec, Stack(policy="fp16")], [("bf16", dec)])
    assert g.rms_nats > 0  # the decode kernel's other roundings: a real gap


@pytest.mark.slow  # emulated programs compile for ~25 CPU s; the test above and the float64
# oracle (emulated, on a tiny function) reach the same code cheaply
def test_identical_emulated_stacks_give_zero_and_bf16_gaps_exceed_fp16(lm):
    stacks = [Stack(policy=f, hardware="h100-cublaslt", mode="decode", kv_block=2)
              for f in ("bf16", "fp16")]  # fmt: skip
    pairs = [(Stack(policy=s.policy, hardware="h100-xla"), s) for s in stacks]
    bf, f16 = _zero_and_nonzero(lm, stacks + [p[0] for p in pairs], pairs)
    assert bf.rms_nats > f16.rms_nats > 0


def test_lm_head_in_float32(lm):
    _, params, tokens, runner = lm
    res = runner.run(Stack(policy="bf16", lm_head_fp32=True), tokens)
    assert res.logits.dtype == np.float32
    x = res.acts["final_norm"]
    assert x.dtype == ml_dtypes.bfloat16
    want = jnp.matmul(jnp.asarray(x, jnp.float32), params["unembed"],
                      precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    np.testing.assert_allclose(res.logits, want, rtol=1e-6, atol=1e-6)
    plain = runner.run("bf16", tokens).logits
    assert plain.dtype == ml_dtypes.bfloat16
    assert not np.array_equal(np.asarray(plain, np.float32), res.logits)


def test_attribution_patches_what_it_says(lm):
    model, params, tokens, runner = lm
    a, b = Stack(policy="bf16"), Stack(policy="bf16", mode="decode", kv_block=2)
    att = attribute(model, params, tokens, a, b, runner=runner)
    names = [r.layer for r in att.layers]
    assert names == list(TransformerLM(model).layers)
    assert att.base.rms_nats == logprob_gap(model, params, tokens, a, b, runner=runner).rms_nats
    assert att.base.rms_nats > 0
    by = {r.layer: r for r in att.layers}
    # the embedding is computed alike in both modes: patching it removes nothing
    assert by["embed"].removed == 0.0 and by["embed"].rms_nats == att.base.rms_nats
    # patching the logits removes everything: the patch reaches the output
    assert by["lm_head"].rms_nats == 0.0 and by["lm_head"].removed == 1.0
    # the shares telescope: injected sums to the last layer's removed share
    assert sum(r.injected for r in att.layers) == pytest.approx(1.0)
    # the attention (the only thing decode computes differently) injects the most
    assert att.ranked()[0].layer.endswith(".attn")
    text = att.text()
    assert "rank" in text and "block0.attn" in text
    with pytest.raises(ValueError, match="unknown layer 'block9'"):
        attribute(model, params, tokens, a, b, layers=["block9"], runner=runner)
    with pytest.raises(ValueError, match="plain logits_fn has none"):
        attribute(_tiny_logits, _tiny_params(), tokens % V, "fp32", "bf16")


def test_a_patch_from_the_other_stack_is_that_stacks_value(lm):
    _, _, tokens, runner = lm
    a, b = Stack(policy="fp16"), Stack(policy="fp16", mode="decode", kv_block=2)
    ra = runner.run(a, tokens)
    rb = runner.run(b, tokens)
    assert not np.array_equal(_bits(rb.acts["block0.attn"]), _bits(ra.acts["block0.attn"]))
    pb = runner.run(b, tokens, patch={"block0.attn": ra.acts["block0.attn"]})
    assert np.array_equal(_bits(pb.acts["block0.attn"]), _bits(ra.acts["block0.attn"]))
    # everything after the patched layer is b's computation on a's values: the MLP, an
    # elementwise row-by-row computation, then gives a's bits too
    assert np.array_equal(_bits(pb.acts["block0.mlp"]), _bits(ra.acts["block0.mlp"]))
    with pytest.raises(ValueError, match="cannot patch 'x'"):
        runner.run(b, tokens, patch={"x": ra.acts["embed"]})


def test_function_lm_checks():
    with pytest.raises(TypeError, match="TransformerLM needs"):
        TransformerLM(object())
    lm = FunctionLM(_tiny_logits)
    assert lm.layers == () and not lm.decodes
