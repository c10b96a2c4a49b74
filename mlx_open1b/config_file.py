"""A run's configuration as a TOML file and as `--set section.key=value` overrides.

Every key, its type and its help text come from the dataclasses of config.py (and gnmr.py for the
[gnmr] table): `keys()` lists them, `to_toml` writes a complete config (every key, its help as a
comment), `resolve` reads one back. Resolution, in order: the preset (the file's `preset` key or
the caller's, default tiny; a name that is no preset labels a file that gives every [model] and
[train] key), the file's values, then each --set in the order given; then the ranges below and
RunConfig.check. Every bad value is a ConfigError naming the key, the allowed
range and where the value came from, raised before the caller writes anything.

A key's value keeps the field's Python type (an integer given for a float field becomes a float):
the resolved RunConfig of a preset's own values is equal to the preset, so its JSON (run.json,
the genesis hash) is the same bytes.
"""
from __future__ import annotations

import dataclasses
import json
import math

from .config import PRECISIONS, PRESETS, ConfigError, ModelConfig, RunConfig, TrainConfig
from .gnmr import GNMRConfig, GNMRError

try:
    import tomllib
except ImportError:                       # Python 3.10: the same parser, as a package
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

INT32_MAX = 2 ** 31 - 1                  # token ids and per-step counts are int32 in the kernels
INT64_MAX = 2 ** 63 - 1                  # step and token counts are written as int64
U64_MAX = 2 ** 64 - 1
INF = math.inf

# The allowed range of every number: (low, high, low open, high open). A test checks that every
# int and float field of ModelConfig and TrainConfig has one; [gnmr] keys are GNMRConfig.check's.
RANGES = {
    "model.vocab_size": (1, INT32_MAX, False, False),
    "model.d_model": (1, INT32_MAX, False, False),
    "model.n_layers": (1, INT32_MAX, False, False),
    "model.n_heads": (1, INT32_MAX, False, False),
    "model.n_kv_heads": (1, INT32_MAX, False, False),
    "model.head_dim": (1, INT32_MAX, False, False),
    "model.ffn_hidden": (1, INT32_MAX, False, False),
    "model.seq_len": (1, INT32_MAX, False, False),
    "model.window": (1, INT32_MAX, False, False),
    "model.global_every": (1, INT32_MAX, False, False),
    "model.rope_theta": (0, INF, True, True),
    "model.norm_eps": (0, INF, True, True),
    "model.z_loss": (0, INF, False, True),
    "model.init_sigma": (0, INF, True, True),
    "train.seed": (0, U64_MAX, False, False),
    "train.microbatch_seqs": (1, INT32_MAX, False, False),
    "train.total_tokens": (1, INT64_MAX, False, False),
    "train.peak_lr": (0, INF, True, True),
    "train.warmup_tokens": (0, INT64_MAX, False, False),     # and < total_tokens (TrainConfig.check)
    "train.final_lr_frac": (0, 1, False, False),
    "train.beta1": (0, 1, False, True),
    "train.beta2": (0, 1, False, True),
    "train.eps": (0, INF, True, True),
    "train.weight_decay": (0, INF, False, True),
    "train.clip_norm": (0, INF, True, True),
    "train.spike_threshold": (0, INF, True, False),          # inf: no step is a spike
    "train.spike_skip": (0, INT32_MAX, False, False),
    "train.checkpoint_every": (1, INT64_MAX, False, False),
    "train.eval_every": (0, INT64_MAX, False, False),        # 0: no held-out evaluation
    "train.eval_windows": (1, INT32_MAX, False, False),
}
CHOICES = {"precision": PRECISIONS, "attention_pv": ("int8", "fp32"),
           "gnmr.mode": ("op", "block")}
# [gnmr]'s ranges in words: GNMRConfig.check enforces them (its messages name the key)
GNMR_RANGES = {"gnmr.alpha": "(0, inf), a normal fp32", "gnmr.alpha_init": "(0, inf), a normal fp32",
               "gnmr.beta": "(0, inf), a normal fp32", "gnmr.eps": "(0, inf), a normal fp32",
               "gnmr.warm": "[0.0, 1.0]", "gnmr.max_o": ">= 0", "gnmr.lock": ">= 0", "gnmr.window": ">= 1"}
PHASES_HELP = "[[from_tokens, microbatches], ...]: from_tokens ascending from 0, microbatches >= 1"

_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "gnmr": GNMRConfig}
_TOP = ("preset", "precision", "attention_pv")


@dataclasses.dataclass(frozen=True)
class Key:
    name: str           # "model.d_model", or "precision" for a top-level key
    type: str           # int, float, str, phases
    help: str
    range: str          # the allowed values, in words

    def describe(self) -> str:
        return f"{self.name} ({self.type}; {self.range}): {self.help}"


def _range_text(name: str, ftype: str) -> str:
    if name in RANGES:
        lo, hi, lo_open, hi_open = RANGES[name]
        fmt = (lambda v: str(v)) if ftype == "int" else (lambda v: "inf" if v == INF else repr(float(v)))
        return f"{'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"
    if name == "train.phases":
        return PHASES_HELP
    if name in CHOICES:
        return "one of " + ", ".join(CHOICES[name])
    if name == "preset":
        return (f"one of {', '.join(sorted(PRESETS))}, or a name of your own in a file that gives every [model] "
                f"and [train] key")
    if name == "gnmr.high":
        return "bf16 (int8 for an int6 or int4 run)"
    if name in GNMR_RANGES:
        return GNMR_RANGES[name]
    return "any"


def _ftype(section: str | None, f: dataclasses.Field) -> str:
    if section == "train" and f.name == "phases":
        return "phases"
    return str(f.type)


def keys() -> list[Key]:
    """Every settable key in file order: the top-level keys, then [model], [train], [gnmr]."""
    out = []
    top = {f.name: f for f in dataclasses.fields(RunConfig)}
    for name in _TOP:
        out.append(Key(name, "str", top[name].metadata["help"], _range_text(name, "str")))
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            t = _ftype(section, f)
            name = f"{section}.{f.name}"
            out.append(Key(name, t, f.metadata["help"], _range_text(name, t)))
    return out


_KEYS = {k.name: k for k in keys()}


# ------------------------------------------------------------------------------ writing
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)                   # the shortest text that reads back as the same binary64
    if isinstance(v, str):
        return json.dumps(v)             # a TOML basic string (the same escapes as JSON)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(cfg: RunConfig) -> str:
    """The complete config as TOML: every key with its help, type and range as a comment."""
    lines = ["# open1b run configuration: `open1b train --config FILE`; `open1b config keys` lists every key",
             ""]

    def put(name, value):
        k = _KEYS[name]
        lines.append(f"# {k.help} ({k.type}; {k.range})")
        lines.append(f"{name.rpartition('.')[2]} = {_toml_value(value)}")

    for name in _TOP:
        put(name, getattr(cfg, name))
    sections = [("model", cfg.model), ("train", cfg.train)] + ([("gnmr", cfg.gnmr)] if cfg.gnmr is not None else [])
    for section, obj in sections:
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(obj):
            put(f"{section}.{f.name}", getattr(obj, f.name))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ reading
def _coerce(name: str, value, where: str):
    """The value of key `name` in its field's type, range-checked; ConfigError naming both."""
    k = _KEYS[name]

    def bad(expect):
        return ConfigError(f"{name}: expected {expect}, got {value!r} ({where})")

    if k.type == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"an integer in {k.range}")
        v = value
    elif k.type == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(f"a number in {k.range}")
        v = float(value)
        if math.isnan(v):
            raise bad(f"a number in {k.range}")
    elif k.type == "str":
        if not isinstance(value, str) or (name in CHOICES and value not in CHOICES[name]):
            raise bad(f"a string, {k.range}")
        return value
    elif k.type == "phases":
        ok = (isinstance(value, (list, tuple)) and len(value) >= 1
              and all(isinstance(p, (list, tuple)) and len(p) == 2
                      and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT64_MAX for x in p)
                      for p in value))
        if not ok:
            raise bad(PHASES_HELP)
        return tuple((int(a), int(b)) for a, b in value)
    else:
        raise AssertionError(f"{name}: unknown key type {k.type}")
    if name in RANGES:
        lo, hi, lo_open, hi_open = RANGES[name]
        if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            raise bad(f"{'an integer' if k.type == 'int' else 'a number'} in {k.range}")
    return v


def _unknown(name: str, where: str) -> ConfigError:
    section = name.partition(".")[0] if "." in name else None
    near = sorted(k for k in _KEYS if section is not None and k.startswith(section + "."))
    hint = f"; keys of [{section}]: {', '.join(k.partition('.')[2] for k in near)}" if near else \
        f"; sections: {', '.join(_SECTIONS)}; top-level keys: {', '.join(_TOP)}"
    return ConfigError(f"unknown key {name!r} ({where}){hint} (`open1b config keys` lists every key)")


def _flatten(doc: dict, where: str) -> list[tuple[str, object]]:
    """[(section.key, value)] of a parsed TOML document, in document order."""
    out = []
    for key, value in doc.items():
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table [{key}], got {value!r} ({where})")
            for sub, v in value.items():
                name = f"{key}.{sub}"
                if name not in _KEYS or isinstance(v, dict):
                    raise _unknown(name, where)
                out.append((name, v))
        elif key in _TOP:
            out.append((key, value))
        else:
            raise _unknown(key, where)
    return out


def load_toml(path) -> dict:
    """The parsed TOML document of a config file; ConfigError naming the file otherwise."""
    if tomllib is None:
        raise ConfigError("reading a TOML config needs Python >= 3.11 (tomllib) or the tomli package")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not a valid TOML file ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a valid TOML file (not UTF-8: {e.reason})") from None


def parse_set(text: str) -> tuple[str, object]:
    """`section.key=value` -> (key, value): the value is read as a TOML value (`3e-4`, `[[0, 2]]`,
    `"text"`), or taken as a bare string when it is not one (`precision=int8`)."""
    name, eq, raw = text.partition("=")
    name = name.strip()
    if not eq or not name:
        raise ConfigError(f"--set {text!r}: expected section.key=value (e.g. train.peak_lr=1e-3)")
    if name not in _KEYS:
        raise _unknown(name, f"--set {text}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"] if tomllib is not None else json.loads(raw)
    except Exception:                 # noqa: BLE001 - not a TOML value: the bare text is the string
        value = raw
    return name, value


def given(name: str, config_file=None, sets=()) -> tuple[object, str] | None:
    """(value, where) of key `name` as the file and the --sets give it explicitly (the last one
    given wins, as in resolve), or None where neither gives it (a preset's value is not given)."""
    found = None
    if config_file is not None:
        for key, value in _flatten(load_toml(config_file), str(config_file)):
            if key == name:
                found = (_coerce(key, value, str(config_file)), str(config_file))
    for text in sets:
        key, value = parse_set(text)
        if key == name:
            found = (_coerce(key, value, f"--set {text}"), f"--set {text}")
    return found


def resolve(preset_name: str | None = None, config_file=None, sets=(), base: RunConfig | None = None) -> RunConfig:
    """The checked RunConfig of a preset, a config file and --set overrides (module docstring).
    base: the config to start from when neither preset_name nor the file names another preset (a
    run's own config on resume, whose preset may be none of PRESETS)."""
    given: list[tuple[str, object, str]] = []
    if config_file is not None:
        where = str(config_file)
        given += [(n, v, where) for n, v in _flatten(load_toml(config_file), where)]
    for text in sets:
        name, value = parse_set(text)
        given.append((name, value, f"--set {text}"))
    name = preset_name
    for key, value, where in given:
        if key == "preset":
            value = _coerce(key, value, where)
            if preset_name is not None and value != preset_name:
                raise ConfigError(f"preset: {where} gives {value!r}, --preset gives {preset_name!r}")
            name = value
    if base is not None and name in (None, base.preset):
        cfg = base
    elif (name or "tiny") in PRESETS:
        cfg = PRESETS[name or "tiny"]
    else:
        # a name of one's own labels a complete config: no preset supplies what the file leaves out
        missing = [k for k in _KEYS if k.startswith(("model.", "train.")) and k not in {g[0] for g in given}]
        if missing:
            raise ConfigError(f"preset: {name!r} is none of the presets ({', '.join(sorted(PRESETS))}); a config "
                              f"that names its own gives every [model] and [train] key (missing: "
                              f"{', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''})")
        cfg = RunConfig(preset=name)
    parts: dict[str, dict] = {"model": {}, "train": {}, "gnmr": {}, "": {}}
    for key, value, where in given:
        section, _, sub = key.rpartition(".")
        parts[section][sub] = _coerce(key, value, where)
    gnmr = cfg.gnmr
    if parts["gnmr"]:
        gnmr = dataclasses.replace(gnmr if gnmr is not None else GNMRConfig(), **parts["gnmr"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **parts["model"]),
                              train=dataclasses.replace(cfg.train, **parts["train"]), gnmr=gnmr,
                              **{k: v for k, v in parts[""].items()})
    try:
        return cfg.check()
    except GNMRError as e:
        raise ConfigError(str(e)) from None


def flat(cfg: RunConfig) -> dict:
    """{section.key: value} of every key (gnmr.* only when the run has a controller)."""
    out = {name: getattr(cfg, name) for name in _TOP}
    for section in ("model", "train", "gnmr"):
        obj = getattr(cfg, section)
        if obj is None:
            out["gnmr"] = None
            continue
        for f in dataclasses.fields(obj):
            out[f"{section}.{f.name}"] = getattr(obj, f.name)
    return out


def first_difference(have: RunConfig, want: RunConfig) -> tuple[str, object, object] | None:
    """(key, have's value, want's value) of the first key (file order) where two configs differ."""
    a, b = flat(have), flat(want)
    for name in list(a) + [n for n in b if n not in a]:
        if a.get(name, None) != b.get(name, None):
            return name, a.get(name), b.get(name)
    return None
