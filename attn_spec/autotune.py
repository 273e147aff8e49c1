"""The autotuner's cache, both frameworks: keys, shape classes, candidate configs, the JSON file, and
the rule by which implementation=None / config=None read it (docs/design/autotune.md).

A key is (framework, device kind, variant, shape class, dtype, flags): the shape class buckets the
sequence lengths to powers of two and keeps the head dim and the GQA group size exactly; the flags
are the variant's features of the call that change which kernels run (softmax: causal, window,
softcap, segments, RoPE, ALiBi, dropout, ordering, offsets; stick-breaking: attend_current,
segments, RoPE, offsets; dilated: causal, merge, ordering and the (segment, rate) branches). An
entry stores the fastest implementation and, for every implementation that was timed, its fastest
config, so an explicit implementation with config=None reads its own tuned config.

The file: `$JAX_ATTN_CACHE` if set, else `$XDG_CACHE_HOME/jax_attn/autotune.json` (default
`~/.cache/jax_attn/autotune.json`); every function takes `path=` to override both. Written
atomically (a temporary file in the same folder, then `os.replace`). Reading:
  - no file: no entry (the heuristic, exactly as without an autotuner);
  - a file that is not valid JSON or not of this format: `CacheError` (a ValueError) naming the
    file. Raised, not warned: a warning would let every later call silently run untuned configs;
    the fix (delete or re-tune the file) is the user's and the message says which file;
  - a well-formed entry that cannot serve the call it matches (its implementation cannot serve
    it, or its config fails the implementation's checks, e.g. a file written by another version):
    a `RuntimeWarning` naming the file and key, and the call runs as if there were no entry.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

FORMAT_VERSION = 1
ENV_VAR = "JAX_ATTN_CACHE"

__all__ = ["CacheError", "DISABLED", "ENV_VAR", "FORMAT_VERSION", "Probe", "ProbeStop", "SHIPPED", "backend_rows",
           "branches_flag", "cache_key", "call_key", "candidate_configs", "config_from_json", "config_to_json",
           "default_path", "load", "lookup", "probe", "record_of", "select", "shape_class", "store", "time_row",
           "using_path"]


class CacheError(ValueError):
    """The autotune cache file cannot be read: its path and what is wrong."""


def default_path() -> Path:
    """`$JAX_ATTN_CACHE`, else `$XDG_CACHE_HOME/jax_attn/autotune.json` (`~/.cache` by default)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jax_attn" / "autotune.json"


# Entries measured on the GPUs named in their keys and shipped with the package: read after the
# user's cache, which overrides them key by key (benchmarks/autotune.py writes them).
SHIPPED = Path(__file__).with_name("autotune_defaults.json")


def _path(path) -> Path:
    return default_path() if path is None else Path(path).expanduser()


def _bucket(n: int) -> int:
    """The power of two >= n (lengths within a factor of two share tiles)."""
    return 1 << max(0, int(n) - 1).bit_length()


def shape_class(q_len: int, kv_len: int, head_dim: int, num_q_heads: int, num_kv_heads: int) -> str:
    """Sequence lengths bucketed to powers of two; head dim and GQA group size exact."""
    for name, value in (("q_len", q_len), ("kv_len", kv_len), ("head_dim", head_dim), ("num_q_heads", num_q_heads),
                        ("num_kv_heads", num_kv_heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_q_heads={num_q_heads}")
    return f"sq{_bucket(q_len)}-sk{_bucket(kv_len)}-d{head_dim}-g{num_q_heads // num_kv_heads}"


def cache_key(framework: str, device_kind: str, variant: str, shape: str, dtype: str, flags: dict[str, Any]) -> str:
    """One string per (framework, device kind, variant, shape class, dtype, flags); flags sorted by
    name, so the key does not depend on the order they are given in."""
    flag_text = ",".join(f"{name}={int(value) if isinstance(value, bool) else value}"
                         for name, value in sorted(flags.items()))
    return "|".join((framework, device_kind, variant, shape, str(dtype), flag_text))


def call_key(framework: str, device_kind: str, variant: str, q_shape, k_shape, dtype: str,
             flags: dict[str, Any]) -> str:
    """The key of one call of any variant: q [B, Sq, Hq, D] and k [B, Sk, Hkv, D] give the shape
    class; `flags` are the variant's features that change which kernels and loops run."""
    shape = shape_class(q_shape[1], k_shape[1], q_shape[3], q_shape[2], k_shape[2])
    return cache_key(framework, device_kind, variant, shape, dtype, flags)


def branches_flag(segment_lengths, dilation_rates) -> str:
    """Dilated attention's branches as one flag value, "2048:2;8192:4" (no ',' or '|', the key's
    separators): each branch runs on its own tiles, so the configuration is part of the key."""
    return ";".join(f"{int(s)}:{int(r)}" for s, r in zip(segment_lengths, dilation_rates))


# ------------------------------------------------------------------------------------------------
# configs <-> JSON
# ------------------------------------------------------------------------------------------------
def config_to_json(config) -> dict | None:
    if config is None:
        return None
    return {"type": type(config).__name__, "fields": dataclasses.asdict(config)}


def config_from_json(data, config_type: type | None):
    """The config `data` describes, as `config_type`; TypeError/ValueError when it does not fit."""
    if data is None:
        if config_type is not None:
            raise ValueError(f"no config stored, a {config_type.__name__} is needed")
        return None
    if config_type is None:
        raise ValueError(f"the implementation takes no config, {data!r} stored")
    if data.get("type") != config_type.__name__:
        raise ValueError(f"config type {data.get('type')!r} stored, a {config_type.__name__} is needed")
    return config_type(**data["fields"])


# ------------------------------------------------------------------------------------------------
# the file
# ------------------------------------------------------------------------------------------------
_MEMO: dict[Path, tuple[tuple[int, int], dict]] = {}  # path -> ((mtime_ns, size), entries): one parse per change


def _check_format(data, path: Path) -> dict:
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
        raise CacheError(f"autotune cache {str(path)!r} is not a version-{FORMAT_VERSION} cache "
                         f"({{'version': {FORMAT_VERSION}, 'entries': {{...}}}}); delete it or re-run autotune")
    for key, record in data["entries"].items():
        if (not isinstance(record, dict) or not isinstance(record.get("implementation"), str)
                or not isinstance(record.get("configs"), dict)
                or record["implementation"] not in record["configs"]
                or not all(c is None or (isinstance(c, dict) and isinstance(c.get("type"), str)
                                         and isinstance(c.get("fields"), dict)) for c in record["configs"].values())):
            raise CacheError(f"autotune cache {str(path)!r}: entry {key!r} is malformed ({record!r}); "
                             f"delete the file or re-run autotune")
    return data["entries"]


def load(path=None) -> dict[str, dict]:
    """key -> entry of the cache file (empty when there is no file); CacheError if it is corrupt."""
    path = _path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    stamp = (st.st_mtime_ns, st.st_size)
    if (memo := _MEMO.get(path)) is not None and memo[0] == stamp:
        return memo[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CacheError(f"autotune cache {str(path)!r} cannot be read: {e}; delete it or re-run autotune") from e
    entries = _check_format(data, path)
    _MEMO[path] = (stamp, entries)
    return entries


def lookup(key: str, path=None) -> dict | None:
    return load(path).get(key)


def store(key: str, record: dict, path=None) -> Path:
    """Add or replace one entry, atomically (a corrupt existing file raises CacheError, untouched)."""
    path = _path(path)
    entries = dict(load(path))
    entries[key] = record
    _check_format({"version": FORMAT_VERSION, "entries": {key: record}}, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": FORMAT_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


# ------------------------------------------------------------------------------------------------
# candidates
# ------------------------------------------------------------------------------------------------
def is_backward_field(name: str) -> bool:
    """A tile config field that only the backward kernels read (the configs name them ..._bwd,
    ..._dkv, ..._dq); the others are the forward's."""
    return name.endswith(("_bwd", "_dkv", "_dq"))


def int_fields(config) -> dict[str, int]:
    """A tile config's integer fields (tiles, warps, stages) by name."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if isinstance(getattr(config, f.name), int) and not isinstance(getattr(config, f.name), bool)}


def candidate_configs(default, valid: Callable[[Any], bool], max_configs: int = 8,
                      canonical: Callable[[Any], Any] = lambda config: config,
                      vary: Callable[[str], bool] = lambda name: True) -> list:
    """`default` first, then its neighbours (forward tiles, backward tiles, single tile sides doubled
    and halved; pipeline stages one more and one fewer) in the fields `vary` names, each built
    through the config class (so its own checks apply) and kept where `valid(config)` (the
    registry's checks for the call); at most `max_configs`, duplicates dropped (two configs are the
    same when `canonical` maps them to equal values: e.g. `BlockSizes.fitted(q_len, kv_len)`, tiles
    larger than the sequence run as smaller ones)."""
    if default is None:
        return [None]
    fields = int_fields(default)
    blocks = [n for n in fields if n.startswith("block_")]
    stages = [n for n in fields if n.startswith("num_stages")]
    changes: list[dict] = []
    for group in ([n for n in blocks if not is_backward_field(n)], [n for n in blocks if is_backward_field(n)]):
        for factor in (2, 0.5):
            if group:
                changes.append({n: int(fields[n] * factor) for n in group})
    for n in blocks:
        for factor in (2, 0.5):
            changes.append({n: int(fields[n] * factor)})
    for n in stages:
        for step in (1, -1):
            changes.append({n: fields[n] + step})
    out, seen = [default], {canonical(default)}
    for change in changes:
        if len(out) >= max_configs:
            break
        if not all(vary(n) for n in change):
            continue
        try:
            config = dataclasses.replace(default, **change)
        except (TypeError, ValueError):
            continue
        if canonical(config) not in seen and valid(config):
            out.append(config)
            seen.add(canonical(config))
    return out


# ------------------------------------------------------------------------------------------------
# the call-time rule
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Probe:
    """What a public function's selection saw (filled while `probe()` is active): the autotuner
    learns a call's key and registry `Call` by tracing the function once."""

    registry: Any = None
    variant: str | None = None
    call: Any = None
    key: str | None = None
    stop: bool = False  # raise ProbeStop once recorded: the call does not run


class ProbeStop(Exception):
    """Raised by `select` inside `probe(stop=True)` once the call's choice is recorded."""


_PROBE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("attn_autotune_probe", default=None)
_PATH: contextvars.ContextVar[Any] = contextvars.ContextVar("attn_autotune_path", default=None)


@contextlib.contextmanager
def probe(stop: bool = False):
    """Record the first selection made inside the block (stop=True: and end that call there, by
    raising ProbeStop, which the block swallows)."""
    p = Probe(stop=stop)
    token = _PROBE.set(p)
    try:
        yield p
    except ProbeStop:
        pass
    finally:
        _PROBE.reset(token)


DISABLED = "<no cache>"  # `using_path(DISABLED)`: calls read no cache


@contextlib.contextmanager
def using_path(path):
    """Calls inside the block read the cache at `path` (None: the default path; `DISABLED`: none,
    so that the autotuner's timing runs run exactly the implementation and config they name)."""
    token = _PATH.set(path)
    try:
        yield
    finally:
        _PATH.reset(token)


def select(registry, variant: str, implementation, config, call, key: Callable[[], str], path=None):
    """(entry, config) of a call: `registry.resolve` and `registry.check_config`, except that with
    config=None an entry for `key()` is read, from the cache file, else from the shipped defaults:
    implementation=None takes the entry's implementation and its config, an explicit implementation
    takes its own tuned config if the entry has one. No entry, or a config given: exactly the
    registry's choice."""
    p = _PROBE.get()
    if p is not None and p.key is None:
        p.registry, p.variant, p.call, p.key = registry, variant, call, key()
        if p.stop:
            raise ProbeStop
    path = path if path is not None else _PATH.get()
    if config is None and path != DISABLED:
        built = None
        for source in (path, SHIPPED):  # the user's cache first, then the shipped entries
            if entries := load(source):  # no file: the key is not even built
                built = built or key()
                if (record := entries.get(built)) is not None:
                    chosen = _from_record(registry, variant, implementation, call, record, built, source)
                    if chosen is not None:
                        return chosen
                    break  # an entry that cannot serve (warned) or did not time the asked one: the registry's
    entry = registry.resolve(variant, implementation, call)
    return entry, registry.check_config(entry, config, call)


def _from_record(registry, variant, implementation, call, record, key, path):
    name = record["implementation"] if implementation is None else registry.canonical(variant, implementation)
    if name not in record["configs"]:
        return None  # an explicit implementation that was not timed: its default
    entry = registry[variant].get(name)
    where = f"autotune cache {str(_path(path))!r}, entry {key!r}"
    if entry is None:
        warnings.warn(f"{where}: unknown implementation {name!r}; using the default choice", RuntimeWarning,
                      stacklevel=4)
        return None
    if reason := entry.unsupported_reason(call):
        if implementation is not None:  # the user asked for it: the registry's error, not the cache's
            return None
        warnings.warn(f"{where}: implementation {name!r} cannot serve this call ({reason}); using the default "
                      f"choice", RuntimeWarning, stacklevel=4)
        return None
    try:
        config = config_from_json(record["configs"][name], entry.config_type())
        config = registry.check_config(entry, config, call)
    except (TypeError, ValueError) as e:
        warnings.warn(f"{where}: stored config for {name!r} does not fit ({e}); using the default choice",
                      RuntimeWarning, stacklevel=4)
        return None
    return entry, config


TIE = 0.02  # implementations this close on forward+backward are told apart by their forward


def _fastest_per_implementation(rows: Iterable[dict], mode: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("mode", mode) == mode and r.get("ms") is not None and (
                r["implementation"] not in out or r["ms"] < out[r["implementation"]]["ms"]):
            out[r["implementation"]] = r
    return out


def record_of(rows: Iterable[dict], mode: str, versions: dict[str, str]) -> tuple[dict, dict] | None:
    """(chosen row, cache entry) of the candidates timed in `mode` (rows: dicts with
    implementation, config, ms, None where the candidate failed, and mode, default `mode`), or None
    when none ran. The chosen row is the fastest; in mode fwd+bwd, of the implementations within
    `TIE` of it whose forward was timed too (the search's "fwd" rows), the one with the fastest
    forward: an entry serves forward-only calls as well, and a difference that small is within a
    run's noise. The entry keeps the chosen implementation and every timed implementation's
    fastest config and time."""
    rows = list(rows)
    per_impl = _fastest_per_implementation(rows, mode)
    if not per_impl:
        return None
    chosen = min(per_impl.values(), key=lambda r: r["ms"])
    forward = _fastest_per_implementation(rows, "fwd") if mode == "fwd+bwd" else {}
    if chosen["implementation"] in forward:  # a near tie goes to the faster forward
        close = [r for r in per_impl.values()
                 if r["implementation"] in forward and r["ms"] <= chosen["ms"] * (1 + TIE)]
        chosen = min(close, key=lambda r: forward[r["implementation"]]["ms"])
    record = {"implementation": chosen["implementation"],
              "configs": {n: config_to_json(r["config"]) for n, r in per_impl.items()},
              "ms": {n: r["ms"] for n, r in per_impl.items()}, "mode": mode, **versions,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    return chosen, record


# ------------------------------------------------------------------------------------------------
# The tuning loop, the same for both frameworks (each supplies its `time_call`)
# ------------------------------------------------------------------------------------------------
MODES = ("fwd", "fwd+bwd")
BATCH_S = 0.01  # a timed repetition runs back-to-back calls for about this long


def batch_size(one_call_s: float) -> int:
    """Calls per timed repetition, from one call's seconds: about BATCH_S of them (at least one, at
    most 1000), so that a call of a fraction of a millisecond is timed on the device, not in its
    dispatch and synchronisation."""
    return max(1, min(1000, round(BATCH_S / max(one_call_s, 1e-6))))


def per_call_ms(timed: Callable[[int], float], reps: int) -> float:
    """The median milliseconds per call over `reps` batches; `timed(calls)` runs that many calls
    back to back, waits for them and returns the seconds per call (each framework's own wait)."""
    calls = batch_size(timed(1))
    return statistics.median(timed(calls) for _ in range(reps)) * 1e3


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The autotuner's answer: the cache key, the chosen (implementation, config) and its time,
    every timed candidate (dicts: implementation, config, mode, ms, error; the forward's tiles are
    searched on mode "fwd" rows) and the file written (None when store=False)."""

    key: str
    implementation: str
    config: Any
    ms: float
    rows: tuple
    path: Any


def check_timing(mode, warmup, reps) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")


def probed(fn, args, kwargs, cache=None) -> Probe:
    """The `Probe` of `fn(*args, **kwargs)`: traced to its implementation choice, nothing run."""
    with using_path(cache), probe(stop=True) as p:
        fn(*args, **kwargs)  # stopped at its choice: nothing runs
    if p.key is None:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} made no implementation choice that the autotuner can "
                         f"key (it serves flash_attention, stick_breaking_attention and "
                         f"dilated_attention)")
    return p


def _given(registry, entry, call, configs):
    """The caller's candidates for this implementation (its config type's), else its default."""
    given = configs.get(entry.name) if isinstance(configs, dict) else configs
    out = [registry.check_config(entry, c, call) for c in (given or ()) if isinstance(c, entry.config_type())]
    return out or [registry.check_config(entry, None, call)]


def _searched(registry, entry, call, max_configs, lengths, time_one, mode):
    """The timed rows of the default config's neighbours. The forward's fields are chosen on the
    forward's time; in mode fwd+bwd the backward's fields then on the forward+backward's, with the
    forward's chosen. Each side's kernels read only their own fields; searched together, a faster
    forward was lost in the backward's noise. The default config stays a candidate to the end."""
    def valid(c):
        try:
            registry.check_config(entry, c, call)
        except (TypeError, ValueError):
            return False
        return True

    def canonical(c):  # tiles past the sequence run as smaller ones: the same kernel
        return c.fitted(*lengths) if hasattr(c, "fitted") else c

    default = registry.check_config(entry, None, call)
    rows = [time_one(c, "fwd") for c in candidate_configs(default, valid, max_configs, canonical,
                                                           vary=lambda n: not is_backward_field(n))]
    if mode == "fwd":
        return rows
    ran = [r for r in rows if r["ms"] is not None]
    forward = min(ran, key=lambda r: r["ms"])["config"] if ran else default
    configs = candidate_configs(forward, valid, max_configs, canonical, vary=is_backward_field)
    if canonical(default) not in {canonical(c) for c in configs}:
        configs.append(default)
    return rows + [time_one(c, "fwd+bwd") for c in configs]


_store = store  # `tune`'s argument `store` (a bool) shadows it there


def time_row(row: dict, f: Callable, args, time_call: Callable, mode: str, warmup: int, reps: int) -> dict:
    """Fill a `benchmark_backends` row with `f(*args)`'s times (`time_call` as in `tune`); a call
    that fails leaves the times None and says why in row["reason"] (reported, not hidden)."""
    try:
        row["ms_fwd"] = time_call(f, args, mode="fwd", warmup=warmup, reps=reps)
        if mode == "fwd+bwd":
            row["ms_fwd_bwd"] = time_call(f, args, mode="fwd+bwd", warmup=warmup, reps=reps)
    except Exception as e:  # noqa: BLE001 - the table says the row did not run and why
        row["reason"] = f"{type(e).__name__}: {e}"
    return row


def backend_rows(fn: Callable, args, kwargs: dict, time_call: Callable, mode: str, warmup: int, reps: int):
    """The rows of `benchmark_backends` (either framework) for our own implementations: every
    implementation of the variant `fn(*args, **kwargs)` chooses for, with the config that
    implementation=<name>, config=None gives it (cached or heuristic), timed, or with the reason it
    cannot serve. -> (variant, kwargs without return_lse, rows); the caller adds its anchors."""
    check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("benchmark_backends times every implementation; pass neither implementation nor config")
    kwargs = {k: v for k, v in kwargs.items() if k != "return_lse"}  # the output alone is timed
    p = probed(fn, args, kwargs)
    rows = []
    for name, entry in p.registry[p.variant].items():
        row = {"implementation": name, "config": None, "ms_fwd": None, "ms_fwd_bwd": None, "reason": None}
        if reason := entry.unsupported_reason(p.call):
            row["reason"] = reason
            rows.append(row)
            continue
        _, row["config"] = select(p.registry, p.variant, name, None, p.call, lambda: p.key)
        call = lambda *a, _n=name, _c=row["config"]: fn(*a, implementation=_n, config=_c, **kwargs)  # noqa: E731
        rows.append(time_row(row, call, args, time_call, mode, warmup, reps))
    return p.variant, kwargs, rows


def tune(fn: Callable, args, kwargs: dict, time_call: Callable, versions: dict[str, str], *, variant=None,
         implementations=None, configs=None, mode: str = "fwd+bwd", warmup: int = 1, reps: int = 5,
         max_configs: int = 8, cache=None, store: bool = True) -> TuneResult:
    """The autotuner of either framework (`jax_attn.autotune`, `torch_ref.autotune`, which document
    the arguments): `fn(*args, **kwargs)` is traced to its implementation choice (key, registry,
    call), every (implementation, config) that can serve it is timed with
    `time_call(f, args, mode=, warmup=, reps=)` -> ms, and the fastest is stored."""
    check_timing(mode, warmup, reps)
    if "implementation" in kwargs or "config" in kwargs:
        raise TypeError("autotune chooses implementation and config; pass neither")
    kwargs = {k: v for k, v in kwargs.items() if k != "return_lse"}  # the output alone is timed
    p = probed(fn, args, kwargs, cache)
    if variant is not None and variant != p.variant:
        raise ValueError(f"variant={variant!r}, but {getattr(fn, '__name__', fn)!r} chooses for "
                         f"variant {p.variant!r}")
    names = tuple(p.registry[p.variant]) if implementations is None else tuple(
        p.registry.canonical(p.variant, n) for n in implementations)
    rows = []
    for name in names:
        entry = p.registry[p.variant][name]
        if reason := entry.unsupported_reason(p.call):
            if implementations is not None:
                raise NotImplementedError(f"implementation={name!r} cannot serve this call: {reason}")
            continue

        def time_one(config, timed_mode, _n=name):
            row = {"implementation": _n, "config": config, "mode": timed_mode, "ms": None, "error": None}
            try:
                with using_path(DISABLED):  # the candidate runs as given, whatever the cache holds
                    row["ms"] = time_call(lambda *a: fn(*a, implementation=_n, config=config, **kwargs),
                                          args, mode=timed_mode, warmup=warmup, reps=reps)
            except Exception as e:  # a tile that does not compile here (e.g. shared memory) is no answer
                row["error"] = f"{type(e).__name__}: {e}"
            return row

        if entry.config_type() is None or configs is not None:
            rows += [time_one(c, mode) for c in ([None] if entry.config_type() is None
                                                 else _given(p.registry, entry, p.call, configs))]
        else:
            rows += _searched(p.registry, entry, p.call, max_configs, (args[0].shape[1], args[1].shape[1]),
                              time_one, mode)
    result = record_of(rows, mode, versions)
    if result is None:
        raise RuntimeError(f"autotune: no candidate ran for {p.key}: " +
                           "; ".join(f"{r['implementation']} {r['config']}: {r['error']}" for r in rows))
    best, record = result
    path = _store(p.key, record, cache) if store else None
    return TuneResult(p.key, best["implementation"], best["config"], best["ms"], tuple(rows), path)
