"""The autotuner's cache (attn_spec.autotune), the rule by which implementation=None / config=None read
it, jax_attn.autotune / torch_ref.autotune and benchmark_backends, at tiny shapes on CPU.

Every test names its own cache file under tmp_path (conftest points the default at an empty
temporary folder, so no test reads a developer's ~/.cache)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import torch_ref
from attn_spec import autotune as tuning
from attn_spec.tiles import BlockSizes
from jax_attn.ops.softmax import triton as jax_softmax_triton

# a valid config no heuristic picks: seen by the kernel only if it came from the cache
DISTINCT = BlockSizes(16, 16, 16, 16, 16, 16, 2, 1, 2, 1)
B, S, HQ, HKV, D = 1, 24, 2, 1, 16


def _jax_qkv():
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal((B, S, h, D)), jnp.float32) for h in (HQ, HKV, HKV))


def _torch_qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, S, h, D, generator=g) for h in (HQ, HKV, HKV))


def _key(fn, args, path, **kwargs):
    with tuning.using_path(path), tuning.probe(stop=True) as p:
        fn(*args, **kwargs)
    return p.key


def _entry(implementation, configs):
    return {"implementation": implementation, "configs": {n: tuning.config_to_json(c) for n, c in configs.items()}}


class _Seen(Exception):
    pass


@pytest.fixture
def jax_kernel_config(monkeypatch):
    """The BlockSizes the Pallas Triton engine receives (the call stops there)."""
    seen = []

    def fake(q, k, v, q_seg, kv_seg, spec, *, blocks=None, **kwargs):
        seen.append(blocks)
        raise _Seen

    monkeypatch.setattr(jax_softmax_triton, "flash_attention_pallas", fake)
    return seen


@pytest.fixture
def torch_kernel_config(monkeypatch):
    """The BlockSizes the Triton autograd Function receives (the call stops there)."""
    kernels = pytest.importorskip("torch_ref.ops.softmax.triton")
    seen = []

    class Fake:
        @staticmethod
        def apply(*args):
            # (q, k, v, q_ids, kv_ids, causal, scale, window, softcap, rope, q_pos, kv_pos, config, ...)
            seen.append(args[12])
            raise _Seen

    monkeypatch.setattr(kernels, "FlashAttentionFn", Fake)
    return seen


# ------------------------------------------------------------------------------------------------
# keys and the file
# ------------------------------------------------------------------------------------------------
def test_shape_class_buckets_lengths_and_keeps_head_dim_and_group():
    assert tuning.shape_class(1000, 1024, 128, 32, 8) == "sq1024-sk1024-d128-g4"
    assert tuning.shape_class(1025, 1, 72, 4, 4) == "sq2048-sk1-d72-g1"
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_q_heads=4"):
        tuning.shape_class(16, 16, 16, 4, 3)
    with pytest.raises(ValueError, match="q_len must be an int >= 1"):
        tuning.shape_class(0, 16, 16, 4, 4)


def test_key_is_stable():
    key = tuning.cache_key("jax", "NVIDIA H100 80GB HBM3", "softmax", "sq4096-sk4096-d128-g1", "bfloat16",
                           {"window": False, "causal": True})
    assert key == "jax|NVIDIA H100 80GB HBM3|softmax|sq4096-sk4096-d128-g1|bfloat16|causal=1,window=0"
    assert key == tuning.cache_key("jax", "NVIDIA H100 80GB HBM3", "softmax", "sq4096-sk4096-d128-g1", "bfloat16",
                                   {"causal": True, "window": False})


def test_public_functions_key_the_call(tmp_path):
    path = tmp_path / "c.json"
    q, k, v = _jax_qkv()
    key = _key(jax_attn.flash_attention, (q, k, v), path, causal=True)
    assert key == ("jax|cpu|softmax|sq32-sk32-d16-g2|float32|alibi=0,causal=1,dropout=0,offset=0,ordered=0,"
                   "positions=0,rope=0,segments=0,softcap=0,window=0")
    assert _key(jax_attn.flash_attention, (q, k, v), path, causal=True) == key  # the same call, the same key
    assert _key(jax_attn.flash_attention, (q, k, v), path, causal=True, window=(4, 0)) != key
    tq, tk, tv = _torch_qkv()
    assert _key(torch_ref.flash_attention, (tq, tk, tv), path, causal=True) == "torch" + key[len("jax"):]


def test_cache_round_trip(tmp_path):
    path = tmp_path / "sub" / "autotune.json"
    assert tuning.load(path) == {}
    record = _entry("triton", {"triton": DISTINCT, "xla": None})
    assert tuning.store("k1", record, path) == path
    tuning.store("k2", _entry("xla", {"xla": None}), path)
    assert tuning.lookup("k1", path) == record and tuning.lookup("k2", path)["implementation"] == "xla"
    stored = json.loads(path.read_text())
    assert stored["version"] == tuning.FORMAT_VERSION and set(stored["entries"]) == {"k1", "k2"}
    assert tuning.config_from_json(tuning.lookup("k1", path)["configs"]["triton"], BlockSizes) == DISTINCT
    assert os.listdir(path.parent) == ["autotune.json"]  # the temporary file was renamed, none left


def test_default_path_honours_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "x.json"))
    assert tuning.default_path() == tmp_path / "x.json"
    monkeypatch.delenv(tuning.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.default_path() == tmp_path / "jax_attn" / "autotune.json"


@pytest.mark.parametrize("text, match", [
    ("{not json", "cannot be read"),
    ('{"entries": {}}', "is not a version-1 cache"),
    ('{"version": 1, "entries": {"k": {"implementation": "triton", "configs": {}}}}', "entry 'k' is malformed"),
])
def test_corrupt_file_raises_naming_it(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(tuning.CacheError, match=match) as e:
        tuning.load(path)
    assert str(path) in str(e.value)
    with pytest.raises(tuning.CacheError, match=match):  # and a store leaves it untouched
        tuning.store("k2", _entry("xla", {"xla": None}), path)
    assert path.read_text() == text


# ------------------------------------------------------------------------------------------------
# the call-time rule, jax_attn
# ------------------------------------------------------------------------------------------------
def test_jax_config_none_reads_the_entry(tmp_path, monkeypatch, jax_kernel_config):
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    q, k, v = _jax_qkv()
    tuning.store(_key(jax_attn.flash_attention, (q, k, v), path, causal=True),
                 _entry("triton", {"triton": DISTINCT, "xla": None}), path)
    for implementation in (None, "triton", "pallas_triton"):
        with pytest.raises(_Seen):
            jax_attn.flash_attention(q, k, v, causal=True, implementation=implementation)
    assert jax_kernel_config == [DISTINCT] * 3
    with pytest.raises(_Seen):  # a given config is used as given
        jax_attn.flash_attention(q, k, v, causal=True, config=BlockSizes())
    with pytest.raises(_Seen):  # another key (not causal): the heuristic
        jax_attn.flash_attention(q, k, v)
    assert jax_kernel_config[3:] == [BlockSizes(), jax_attn.default_block_sizes(D, True, jnp.float32)]


def test_jax_entry_picks_the_implementation(tmp_path, monkeypatch, jax_kernel_config):
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    q, k, v = _jax_qkv()
    tuning.store(_key(jax_attn.flash_attention, (q, k, v), path, causal=True), _entry("xla", {"xla": None}), path)
    out = jax_attn.flash_attention(q, k, v, causal=True)  # "xla", not the (patched) Triton engine
    assert not jax_kernel_config
    np.testing.assert_array_equal(out, jax_attn.flash_attention(q, k, v, causal=True, implementation="xla"))
    with pytest.raises(_Seen):  # an explicit implementation the entry did not time: its default
        jax_attn.flash_attention(q, k, v, causal=True, implementation="triton")
    assert jax_kernel_config == [jax_attn.default_block_sizes(D, True, jnp.float32)]


def test_jax_no_entry_leaves_the_choice(tmp_path, monkeypatch, jax_kernel_config):
    q, k, v = _jax_qkv()
    default = jax_attn.default_block_sizes(D, True, jnp.float32)
    monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path / "none.json"))  # no file
    with pytest.raises(_Seen):
        jax_attn.flash_attention(q, k, v, causal=True)
    tuning.store("jax|other|softmax|x|float32|", _entry("xla", {"xla": None}), tmp_path / "none.json")
    with pytest.raises(_Seen):  # a file without this key
        jax_attn.flash_attention(q, k, v, causal=True)
    assert jax_kernel_config == [default, default]


def test_shipped_entries_are_well_formed():
    """The defaults in the package: the cache format, GPU device kinds, configs their classes accept."""
    from jax_attn.ops.softmax.mosaic import MosaicBlockSizes
    entries = tuning.load(tuning.SHIPPED)
    assert entries
    types = {"BlockSizes": BlockSizes, "MosaicBlockSizes": MosaicBlockSizes}
    for key, record in entries.items():
        framework, device, variant = key.split("|")[:3]
        assert framework in ("jax", "torch") and device.startswith("NVIDIA") and variant == "softmax", key
        assert record["implementation"] in record["configs"], key
        for stored in record["configs"].values():
            if stored is not None:
                assert isinstance(tuning.config_from_json(stored, types[stored["type"]]), types[stored["type"]])


def test_jax_shipped_entry_read_after_the_cache(tmp_path, monkeypatch, jax_kernel_config):
    shipped, user = tmp_path / "shipped.json", tmp_path / "user.json"
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    monkeypatch.setenv(tuning.ENV_VAR, str(user))
    q, k, v = _jax_qkv()
    key = _key(jax_attn.flash_attention, (q, k, v), user, causal=True)
    tuning.store(key, _entry("triton", {"triton": DISTINCT, "xla": None}), shipped)
    with pytest.raises(_Seen):  # no user file: the shipped entry
        jax_attn.flash_attention(q, k, v, causal=True)
    tuning.store("jax|other|softmax|x|float32|", _entry("xla", {"xla": None}), user)
    with pytest.raises(_Seen):  # a user file without this key: still the shipped entry
        jax_attn.flash_attention(q, k, v, causal=True)
    assert jax_kernel_config == [DISTINCT, DISTINCT]
    tuning.store(key, _entry("triton", {"triton": BlockSizes(), "xla": None}), user)
    with pytest.raises(_Seen):  # the user's entry for the key overrides the shipped one
        jax_attn.flash_attention(q, k, v, causal=True)
    with tuning.using_path(tuning.DISABLED), pytest.raises(_Seen):  # no cache at all: the heuristic
        jax_attn.flash_attention(q, k, v, causal=True)
    assert jax_kernel_config[2:] == [BlockSizes(), jax_attn.default_block_sizes(D, True, jnp.float32)]


def test_jax_invalid_entries(tmp_path, monkeypatch, jax_kernel_config):
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    q, k, v = _jax_qkv()
    key = _key(jax_attn.flash_attention, (q, k, v), path, causal=True)
    default = jax_attn.default_block_sizes(D, True, jnp.float32)
    bad = {"type": "BlockSizes", "fields": {**tuning.config_to_json(DISTINCT)["fields"], "block_q": 24}}
    for record, match in ((_entry("triton", {"triton": None}) | {"configs": {"triton": bad}}, "does not fit"),
                          (_entry("mosaic", {"mosaic": None}), "cannot serve this call"),
                          (_entry("cudnn", {"cudnn": None}), "unknown implementation 'cudnn'")):
        tuning.store(key, record, path)
        with pytest.warns(RuntimeWarning, match=match), pytest.raises(_Seen):
            jax_attn.flash_attention(q, k, v, causal=True)
    assert jax_kernel_config == [default] * 3
    path.write_text("{oops")
    with pytest.raises(tuning.CacheError, match="cannot be read"):
        jax_attn.flash_attention(q, k, v, causal=True)
    with pytest.raises(_Seen):  # a given config reads no file
        jax_attn.flash_attention(q, k, v, causal=True, config=DISTINCT)


def test_jax_autotune_stores_what_config_none_reads(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    q, k, v = _jax_qkv()
    result = jax_attn.autotune(jax_attn.flash_attention, q, k, v, causal=True, implementations=["triton"],
                               configs=[DISTINCT], mode="fwd", reps=1, cache=path)
    assert (result.implementation, result.config, result.path) == ("triton", DISTINCT, path)
    assert [r["implementation"] for r in result.rows] == ["triton"] and result.ms > 0
    entry = tuning.lookup(result.key, path)
    assert entry["implementation"] == "triton" and entry["mode"] == "fwd"
    seen = []
    monkeypatch.setattr(jax_softmax_triton, "flash_attention_pallas",
                        lambda *a, blocks=None, **kw: (seen.append(blocks), (_ for _ in ()).throw(_Seen)))
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    with pytest.raises(_Seen):
        jax_attn.flash_attention(q, k, v, causal=True)
    assert seen == [DISTINCT]


def test_jax_candidates_are_valid_and_distinct():
    call = jax_attn.registry.Call(jax_attn.AttentionSpec(scale=1.0), 64, jnp.bfloat16)
    entry = jax_attn.registry.REGISTRY["softmax"]["mosaic"]
    default = entry.default_config(call)
    out = tuning.candidate_configs(default, lambda c: True, max_configs=6)
    assert out[0] == default and len(set(out)) == len(out) <= 6
    assert all(c.block_q % 64 == 0 and c.num_stages >= 2 for c in out)  # MosaicBlockSizes' own checks held


def _sides(config):
    fields = tuning.int_fields(config)
    return ({n: x for n, x in fields.items() if not tuning.is_backward_field(n)},
            {n: x for n, x in fields.items() if tuning.is_backward_field(n)})


@pytest.mark.parametrize("side", ["forward", "backward"])
def test_candidates_vary_only_the_named_side(side):
    default = BlockSizes()
    vary = (lambda n: not tuning.is_backward_field(n)) if side == "forward" else tuning.is_backward_field
    out = tuning.candidate_configs(default, lambda c: True, max_configs=8, vary=vary)
    kept = 1 if side == "forward" else 0  # the side left alone
    assert len(out) > 2 and all(_sides(c)[kept] == _sides(default)[kept] for c in out)
    assert {tuple(_sides(c)[1 - kept].items()) for c in out[1:]} != {tuple(_sides(default)[1 - kept].items())}


def test_batch_size_fills_a_repetition():
    assert tuning.batch_size(1.0) == 1 and tuning.batch_size(0.001) == 10
    assert tuning.batch_size(1e-5) == 1000 and tuning.batch_size(0.0) == 1000


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_search_times_the_forward_tiles_on_the_forward(tmp_path, framework):
    """mode fwd+bwd: the forward's neighbours are timed forward only, then the backward's, with the
    fastest forward's fields (and the default config, kept as a candidate) on forward+backward; the
    stored choice is one of the latter."""
    if framework == "jax":
        tune, fn, args = jax_attn.autotune, jax_attn.flash_attention, _jax_qkv()
    else:
        tune, fn, args = torch_ref.autotune, torch_ref.flash_attention, _torch_qkv()
    result = tune(fn, *args, causal=True, implementations=["triton"], reps=1, max_configs=3,
                  cache=tmp_path / "c.json")
    fwd = [r for r in result.rows if r["mode"] == "fwd"]
    both = [r for r in result.rows if r["mode"] == "fwd+bwd"]
    assert [r["mode"] for r in result.rows] == ["fwd"] * len(fwd) + ["fwd+bwd"] * len(both)
    default = fwd[0]["config"]
    assert len(fwd) == 3 and all(_sides(r["config"])[1] == _sides(default)[1] for r in fwd)
    best = min((r for r in fwd if r["ms"] is not None), key=lambda r: r["ms"])["config"]
    assert any(r["config"] == default for r in both)
    assert len(both) > 1 and all(_sides(r["config"])[0] == _sides(best)[0] for r in both if r["config"] != default)
    assert result.config in [r["config"] for r in both]
    assert result.ms == min(r["ms"] for r in both if r["ms"] is not None)
    assert tuning.lookup(result.key, tmp_path / "c.json")["mode"] == "fwd+bwd"


def test_near_ties_go_to_the_faster_forward():
    a, b = BlockSizes(), DISTINCT
    row = lambda impl, config, mode, ms: {"implementation": impl, "config": config, "mode": mode, "ms": ms}
    timed = [row("one", a, "fwd", 0.20), row("two", b, "fwd", 0.18), row("one", a, "fwd+bwd", 1.00)]
    close = timed + [row("two", b, "fwd+bwd", 1.00 * (1 + tuning.TIE / 2))]
    far = timed + [row("two", b, "fwd+bwd", 1.00 * (1 + 2 * tuning.TIE))]
    assert tuning.record_of(close, "fwd+bwd", {})[0]["implementation"] == "two"
    assert tuning.record_of(far, "fwd+bwd", {})[0]["implementation"] == "one"
    assert tuning.record_of(close, "fwd", {})[0]["implementation"] == "two"  # the forward's own rows
    no_forward = [r for r in close if not (r["implementation"] == "one" and r["mode"] == "fwd")]
    assert tuning.record_of(no_forward, "fwd+bwd", {})[0]["implementation"] == "one"  # the fastest's forward unknown
    record = tuning.record_of(close, "fwd+bwd", {})[1]
    assert record["ms"] == {"one": 1.00, "two": 1.00 * (1 + tuning.TIE / 2)} and record["implementation"] == "two"


def test_jax_benchmark_backends_rows():
    q, k, v = _jax_qkv()
    rows = jax_attn.benchmark_backends(q, k, v, causal=True, reps=1)
    by = {r["implementation"]: r for r in rows}
    assert list(by) == ["triton", "mosaic", "xla", "jax.nn:cudnn", "jax.nn:xla"]
    for name in ("triton", "xla", "jax.nn:xla"):
        assert by[name]["reason"] is None and by[name]["ms_fwd"] > 0 and by[name]["ms_fwd_bwd"] > 0
    assert by["triton"]["config"] == jax_attn.default_block_sizes(D, True, jnp.float32)
    assert "float16 or bfloat16" in by["mosaic"]["reason"] and by["mosaic"]["ms_fwd"] is None
    assert "cuDNN needs an NVIDIA GPU" in by["jax.nn:cudnn"]["reason"]
    rows = jax_attn.benchmark_backends(q, k, v, softcap=5.0, mode="fwd", reps=1)
    assert "not softcap" in rows[-1]["reason"] and rows[0]["ms_fwd_bwd"] is None


# ------------------------------------------------------------------------------------------------
# torch_ref
# ------------------------------------------------------------------------------------------------
def test_torch_config_none_reads_the_entry(tmp_path, monkeypatch, torch_kernel_config):
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    q, k, v = _torch_qkv()
    default = torch_ref.default_block_sizes(D, torch.float32, False)
    with pytest.raises(_Seen):  # no file: the heuristic
        torch_ref.flash_attention(q, k, v, causal=True)
    tuning.store(_key(torch_ref.flash_attention, (q, k, v), path, causal=True),
                 _entry("triton", {"triton": DISTINCT, "eager": None}), path)
    for implementation in (None, "triton"):
        with pytest.raises(_Seen):
            torch_ref.flash_attention(q, k, v, causal=True, implementation=implementation)
    with pytest.raises(_Seen):  # another key: the heuristic
        torch_ref.flash_attention(q, k, v)
    assert torch_kernel_config == [default, DISTINCT, DISTINCT, default]
    path.write_text("[]")
    with pytest.raises(tuning.CacheError, match="not a version-1 cache"):
        torch_ref.flash_attention(q, k, v, causal=True)


def test_torch_autotune_and_benchmark_backends(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    q, k, v = _torch_qkv()
    result = torch_ref.autotune(torch_ref.flash_attention, q, k, v, causal=True, configs={"triton": [DISTINCT]},
                                mode="fwd", reps=1, cache=path)
    assert {r["implementation"] for r in result.rows} == {"triton", "eager"}
    entry = tuning.lookup(result.key, path)
    assert tuning.config_from_json(entry["configs"]["triton"], BlockSizes) == DISTINCT
    assert entry["implementation"] == result.implementation
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    rows = torch_ref.benchmark_backends(q, k, v, causal=True, reps=1)
    by = {r["implementation"]: r for r in rows}
    assert list(by) == ["triton", "eager", "sdpa:math", "sdpa:efficient", "sdpa:flash", "sdpa:cudnn"]
    assert by["triton"]["config"] == DISTINCT  # implementation="triton", config=None reads its tuned config
    for name in ("triton", "eager", "sdpa:math"):
        assert by[name]["reason"] is None and by[name]["ms_fwd"] > 0 and by[name]["ms_fwd_bwd"] > 0
    for r in rows:  # every row either ran or says why not
        assert (r["ms_fwd"] is None) == (r["reason"] is not None)


@pytest.mark.gpu
def test_gpu_autotune_then_config_none_runs_the_tuned_choice(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 2048, 8, 128), jnp.bfloat16) for kk in keys)
    result = jax_attn.autotune(jax_attn.flash_attention, q, k, v, causal=True, reps=3, max_configs=4, cache=path)
    assert {r["implementation"] for r in result.rows} >= {"triton", "xla"}
    assert all(r["error"] is None for r in result.rows if r["config"] == result.rows[0]["config"])
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    out = jax_attn.flash_attention(q, k, v, causal=True)
    expected = jax_attn.flash_attention(q, k, v, causal=True, implementation=result.implementation,
                                        config=result.config)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    rows = jax_attn.benchmark_backends(q, k, v, causal=True, reps=3)
    by = {r["implementation"]: r for r in rows}
    assert by["jax.nn:cudnn"]["ms_fwd"] is not None or by["jax.nn:cudnn"]["reason"]
    assert by[result.implementation]["config"] == result.config


def test_autotune_argument_errors(tmp_path):
    q, k, v = _jax_qkv()
    with pytest.raises(ValueError, match="variant='nsa', but 'flash_attention' chooses for variant 'softmax'"):
        jax_attn.autotune(jax_attn.flash_attention, q, k, v, variant="nsa", cache=tmp_path / "c.json")
    with pytest.raises(NotImplementedError, match="implementation='mosaic' cannot serve this call"):
        jax_attn.autotune(jax_attn.flash_attention, q, k, v, implementations=["mosaic"], cache=tmp_path / "c.json")
    with pytest.raises(TypeError, match="pass neither"):
        jax_attn.autotune(jax_attn.flash_attention, q, k, v, config=DISTINCT, cache=tmp_path / "c.json")
    with pytest.raises(ValueError, match="mode must be one of"):
        torch_ref.autotune(torch_ref.flash_attention, *_torch_qkv(), mode="bwd", cache=tmp_path / "c.json")
    with pytest.raises(ValueError, match="made no implementation choice"):
        jax_attn.autotune(lambda q, k, v: q, q, k, v, cache=tmp_path / "c.json")
    assert not (tmp_path / "c.json").exists()


# ------------------------------------------------------------------------------------------------
# stick-breaking and dilated attention: the same cache, keyed by their own flags
# ------------------------------------------------------------------------------------------------
SEGMENTS = dict(segment_lengths=(8, 16), dilation_rates=(1, 2))
SHAPE = "sq32-sk32-d16-g2|float32"


def _variant_case(framework, variant, monkeypatch):
    """(fn, q/k/v, kwargs, expected key, a valid config no heuristic picks, the default config, the
    configs the kernel saw): the kernel entry point is patched to record its config and stop."""
    seen = []
    record = lambda config: (seen.append(config), (_ for _ in ()).throw(_Seen))
    if framework == "jax":
        from jax_attn.ops.dilated import triton as dilated_kernels
        from jax_attn.ops.stick_breaking import triton as sb_kernels
        qkv, call_q = _jax_qkv(), jax_attn.registry.Call(jax_attn.AttentionSpec(scale=1.0), D, jnp.float32)
        if variant == "stick_breaking":
            monkeypatch.setattr(sb_kernels, "stick_breaking_pallas", lambda *a, blocks=None, **kw: record(blocks))
            distinct = sb_kernels.StickBreakingBlockSizes(32, 32, 32, 4, 1)
            default = jax_attn.registry.REGISTRY["stick_breaking"]["triton"].default_config(call_q)
        else:
            monkeypatch.setattr(dilated_kernels, "dilated_attention_triton",
                                lambda *a, blocks=None, **kw: record(blocks))
            distinct, default = DISTINCT, jax_attn.default_block_sizes(D, True, jnp.float32)
    else:
        sb_kernels = pytest.importorskip("torch_ref.ops.stick_breaking.triton")
        dilated_kernels = pytest.importorskip("torch_ref.ops.dilated.triton")
        qkv = _torch_qkv()
        if variant == "stick_breaking":
            class Fake:
                @staticmethod
                def apply(*args):  # (q, k, v, decay_t, decay_value, scale, rope, q_pos, kv_pos, config, ...)
                    record(args[9])
            monkeypatch.setattr(sb_kernels, "StickBreakingFn", Fake)
            distinct = sb_kernels.StickBreakingBlockSizes(32, 16, 32, 16, 32)
            default = sb_kernels.default_stick_breaking_block_sizes(D, torch.float32, False)
        else:
            monkeypatch.setattr(dilated_kernels, "dilated_attention_triton",
                                lambda *a, config=None, **kw: record(config))
            distinct, default = DISTINCT, torch_ref.default_block_sizes(D, torch.float32, False)
    fn = getattr(jax_attn if framework == "jax" else torch_ref, f"{variant}_attention")
    if variant == "stick_breaking":
        kwargs = dict(attend_current=True)
        flags = "attend_current=1,kv_positions=0,offset=0,positions=0,rope=0,segments=0"
    else:
        kwargs = dict(SEGMENTS, causal=True)
        flags = "branches=8:1;16:2,causal=1,merge=lse,ordered=0"
    assert distinct != default
    return fn, qkv, kwargs, f"{framework}|cpu|{variant}|{SHAPE}|{flags}", distinct, default, seen


VARIANT_CASES = [(f, v) for f in ("jax", "torch") for v in ("stick_breaking", "dilated")]


@pytest.mark.parametrize("framework, variant", VARIANT_CASES)
def test_variant_key_and_default_without_a_file(tmp_path, monkeypatch, framework, variant):
    fn, qkv, kwargs, key, distinct, default, seen = _variant_case(framework, variant, monkeypatch)
    path = tmp_path / "none.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    assert _key(fn, qkv, path, **kwargs) == key
    if variant == "dilated":  # the branches are part of the key
        assert _key(fn, qkv, path, **{**kwargs, "dilation_rates": (1, 4)}) != key
    else:
        assert _key(fn, qkv, path, **{**kwargs, "attend_current": False}) != key
    with pytest.raises(_Seen):  # no file: the default config
        fn(*qkv, **kwargs)
    assert seen == [default] and not path.exists()


@pytest.mark.parametrize("framework, variant", VARIANT_CASES)
def test_variant_config_none_reads_the_entry(tmp_path, monkeypatch, framework, variant):
    fn, qkv, kwargs, key, distinct, default, seen = _variant_case(framework, variant, monkeypatch)
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    tuning.store(key, _entry("triton", {"triton": distinct}), path)
    for implementation in (None, "triton"):
        with pytest.raises(_Seen):
            fn(*qkv, implementation=implementation, **kwargs)
    with pytest.raises(_Seen):  # a given config is used as given
        fn(*qkv, config=default, **kwargs)
    other = {**kwargs, "dilation_rates": (1, 4)} if variant == "dilated" else {**kwargs, "attend_current": False}
    with pytest.raises(_Seen):  # another key: the default
        fn(*qkv, **other)
    assert seen == [distinct, distinct, default, default]


@pytest.mark.parametrize("framework, variant", VARIANT_CASES)
def test_variant_entry_that_cannot_serve_warns(tmp_path, monkeypatch, framework, variant):
    fn, qkv, kwargs, key, distinct, default, seen = _variant_case(framework, variant, monkeypatch)
    path = tmp_path / "c.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    wrong = BlockSizes() if variant == "stick_breaking" else _stick_breaking_config(framework)
    records = [(_entry("triton", {"triton": wrong}), "does not fit"),
               (_entry("cudnn", {"cudnn": None}), "unknown implementation 'cudnn'")]
    if framework == "jax":  # the Mosaic kernels take no float32 (nor a CPU)
        records.append((_entry("mosaic", {"mosaic": None}), "cannot serve this call"))
    for record, match in records:
        tuning.store(key, record, path)
        with pytest.warns(RuntimeWarning, match=match), pytest.raises(_Seen):
            fn(*qkv, **kwargs)
    assert seen == [default] * len(records)


def _stick_breaking_config(framework):
    if framework == "jax":
        from jax_attn.ops.stick_breaking.triton import StickBreakingBlockSizes
    else:
        from torch_ref.ops.stick_breaking.triton import StickBreakingBlockSizes
    return StickBreakingBlockSizes()


@pytest.mark.parametrize("framework, variant", VARIANT_CASES)
def test_variant_autotune_stores_what_config_none_reads(tmp_path, monkeypatch, framework, variant):
    fn, qkv, kwargs, key, distinct, default, seen = _variant_case(framework, variant, monkeypatch)
    monkeypatch.undo()  # the autotuner runs the real kernels; the spy comes back below
    path = tmp_path / "c.json"
    tune = jax_attn.autotune if framework == "jax" else torch_ref.autotune
    result = tune(fn, *qkv, implementations=["triton"], configs=[distinct], mode="fwd", reps=1, cache=path,
                  **kwargs)
    assert (result.key, result.implementation, result.config, result.path) == (key, "triton", distinct, path)
    assert [r["error"] for r in result.rows] == [None]
    entry = tuning.lookup(key, path)
    assert entry["implementation"] == "triton" and entry["mode"] == "fwd"
    assert tuning.config_from_json(entry["configs"]["triton"], type(distinct)) == distinct
    fn, qkv, kwargs, key, distinct, default, seen = _variant_case(framework, variant, monkeypatch)
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    with pytest.raises(_Seen):
        fn(*qkv, **kwargs)
    assert seen == [distinct]


def test_jax_dilated_mosaic_takes_mosaic_block_sizes(monkeypatch):
    from jax_attn.ops.dilated import triton as dilated_kernels
    from jax_attn.ops.softmax.mosaic import MosaicBlockSizes, default_mosaic_block_sizes
    entry = jax_attn.registry.REGISTRY["dilated"]["mosaic"]
    call = jax_attn.registry.Call(jax_attn.AttentionSpec(scale=1.0, causal=True), 64, jnp.bfloat16)
    assert entry.config_type() is MosaicBlockSizes and entry.default_config(call) == default_mosaic_block_sizes(64)
    with pytest.raises(TypeError, match="MosaicBlockSizes"):
        jax_attn.registry.check_config(entry, DISTINCT, call)
    seen = []
    monkeypatch.setattr(dilated_kernels, "dilated_attention_triton", lambda *a, **kw: seen.append(kw))
    tiles = MosaicBlockSizes(block_q=128, block_k=64, num_stages=3)
    entry.fn(*_jax_qkv(), call.spec, merge="lse", config=tiles, **SEGMENTS)
    assert seen[0]["mosaic"] and seen[0]["mosaic_blocks"] == tiles  # the Hopper branches' tiles


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["stick_breaking", "dilated"])
def test_gpu_variant_autotune_then_config_none_runs_the_tuned_choice(tmp_path, monkeypatch, variant):
    path = tmp_path / "c.json"
    kwargs = dict(segment_lengths=(1024, 4096), dilation_rates=(1, 4), causal=True) if variant == "dilated" else {}
    fn = getattr(jax_attn, f"{variant}_attention")
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 4096, 8, 128), jnp.bfloat16) for kk in keys)
    result = jax_attn.autotune(fn, q, k, v, reps=3, max_configs=3, cache=path, **kwargs)
    assert {r["implementation"] for r in result.rows} >= {"triton", "mosaic", "xla"}
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    out = fn(q, k, v, **kwargs)
    expected = fn(q, k, v, implementation=result.implementation, config=result.config, **kwargs)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).cuda().to(torch.bfloat16) for x in (q, k, v))
    tfn = getattr(torch_ref, f"{variant}_attention")
    result = torch_ref.autotune(tfn, tq, tk, tv, reps=3, max_configs=3, cache=path, **kwargs)
    assert result.key.startswith("torch|") and tuning.lookup(result.key, path)["implementation"] in ("triton", "eager")
    torch.testing.assert_close(tfn(tq, tk, tv, **kwargs),
                               tfn(tq, tk, tv, implementation=result.implementation, config=result.config,
                                   **kwargs), rtol=0, atol=0)
