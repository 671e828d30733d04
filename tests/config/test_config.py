"""specjax.config: strict dataclass <-> YAML <-> CLI-override round trips, and the shipped YAML files."""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Literal, Optional, Union

import pytest
import yaml

from specjax.config import (
    SPECULATIVE_METHODS,
    BackendConfig,
    ConfigError,
    ModelConfig,
    RunConfig,
    SamplingParams,
    SpeculativeConfig,
    apply_overrides,
    available_configs,
    from_dict,
    load_run_config,
    load_yaml,
    load_yaml_dict,
    merge,
    packaged_config_path,
    to_dict,
    to_yaml,
)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
# Run configs; training configs (configs/train/, `specjax train-head`) have their own schema, tested below.
YAML_FILES = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name != "train")
TRAIN_YAML_FILES = sorted((CONFIG_DIR / "train").glob("*.yaml"))


# ------------------------------------------------------------------------------------------------ shipped YAMLs


def test_config_dir_has_yaml_files():
    # Guards the parametrized test below: an empty glob would make it pass vacuously.
    assert len(YAML_FILES) >= 9, YAML_FILES
    names = {p.relative_to(CONFIG_DIR).with_suffix("").as_posix() for p in YAML_FILES}
    expected = {"default", "models/smollm2-135m"} | {f"methods/{m}" for m in SPECULATIVE_METHODS + ("plain",)}
    assert expected <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(CONFIG_DIR).as_posix())
def test_every_yaml_loads_into_run_config(path):
    cfg = load_yaml(RunConfig, path)
    assert isinstance(cfg, RunConfig)
    hash(cfg)
    # Packaged lookup by name finds the same file.
    name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
    assert packaged_config_path(name).resolve() == path.resolve()
    assert name in available_configs()
    # Round trip through YAML text.
    assert from_dict(RunConfig, yaml.safe_load(to_yaml(cfg))) == cfg


def test_default_yaml_matches_dataclass_defaults():
    cfg = load_yaml(RunConfig, CONFIG_DIR / "default.yaml")
    assert cfg == RunConfig()
    assert cfg.model.model == "smollm2-135m"
    assert cfg.sampling.is_greedy and cfg.sampling.max_new_tokens == 128
    assert cfg.speculative.method is None and not cfg.speculative.enabled
    # default.yaml spells out every key, so a renamed field cannot silently fall back to its default.
    assert load_yaml_dict(CONFIG_DIR / "default.yaml") == to_dict(RunConfig())


@pytest.mark.parametrize("method", SPECULATIVE_METHODS + ("plain",))
def test_method_yaml_selects_its_method(method):
    cfg = load_yaml(RunConfig, packaged_config_path(f"methods/{method}"))
    assert cfg.speculative.method == (None if method == "plain" else method)
    assert not cfg.speculative.is_lossy
    if method in ("draft_model", "medusa", "eagle", "eagle3"):
        assert cfg.speculative.model


def test_method_fragments_layer_over_each_other():
    eagle = load_run_config("methods/eagle")
    assert eagle.speculative.method == "eagle"
    # plain.yaml also clears the head path, so it can be layered over a model-based method.
    plain = merge(eagle, load_yaml_dict(packaged_config_path("methods/plain")))
    assert plain.speculative.method is None and plain.speculative.model is None
    assert load_run_config("methods/ngram", ["sampling.temperature=0.5"]).sampling.temperature == 0.5


# ------------------------------------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize(
    "data, message",
    [
        ({"batch_sise": 2}, "unknown key 'batch_sise' in RunConfig (did you mean 'batch_size'?)"),
        ({"model": {"dtyp": "float32"}}, "unknown key 'dtyp' in model (did you mean 'dtype'?)"),
        ({"sampling": {"temprature": 0.5}}, "unknown key 'temprature' in sampling (did you mean 'temperature'?)"),
        ({"speculative": {"num_speculative_token": 3}},
         "unknown key 'num_speculative_token' in speculative (did you mean 'num_speculative_tokens'?)"),
        ({"backend": {"backnd": "cpu"}}, "unknown key 'backnd' in backend (did you mean 'backend'?)"),
    ],
)
def test_unknown_key_did_you_mean(data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data)
    assert str(err.value) == message


def test_unknown_key_without_close_match_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'zzz' in sampling; valid keys: .*temperature"):
        from_dict(RunConfig, {"sampling": {"zzz": 1}})


def test_unknown_key_in_yaml_file_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sampling:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(RunConfig, path)
    assert str(path) in str(err.value) and "did you mean 'temperature'" in str(err.value)


def test_unknown_key_nested_location_is_prefixed():
    @dataclass(frozen=True)
    class Outer:
        run: RunConfig = dataclasses.field(default_factory=RunConfig)

    with pytest.raises(ConfigError, match=r"unknown key 'tp' in run\.sampling"):
        from_dict(Outer, {"run": {"sampling": {"tp": 1}}})
    with pytest.raises(ConfigError, match=r"invalid run\.sampling\.top_p=2\.0"):
        from_dict(Outer, {"run": {"sampling": {"top_p": 2}}})


# ------------------------------------------------------------------------------------------------ invalid values


@pytest.mark.parametrize(
    "data, field",
    [
        ({"sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
        ({"sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"sampling": {"top_k": -1}}, "sampling.top_k"),
        ({"sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens"),
        ({"sampling": {"stop_token_ids": [3, -1]}}, "sampling.stop_token_ids[1]"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 0}}, "speculative.num_speculative_tokens"),
        ({"speculative": {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}},
         "speculative.prompt_lookup_min"),
        ({"speculative": {"method": "draft_model"}}, "speculative.model"),
        ({"speculative": {"model": "x"}}, "speculative.model"),
        ({"speculative": {"tree_choices": [[0], [1, 0]]}}, "speculative.tree_choices[1]"),
        ({"speculative": {"tree_choices": [[0], [0]]}}, "speculative.tree_choices[1]"),
        ({"speculative": {"suffix_min_token_prob": 1.5}}, "speculative.suffix_min_token_prob"),
        ({"model": {"dtype": "float16"}}, "model.dtype"),
        ({"model": {"max_context": 0}}, "model.max_context"),
        ({"backend": {"backend": "cuda"}}, "backend.backend"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_invalid_value_names_field(data, field):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data)
    assert str(err.value).startswith(f"invalid {field}="), str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_method_lists_methods_with_did_you_mean():
    with pytest.raises(ConfigError) as err:
        SpeculativeConfig.from_user({"method": "ngrm"})
    msg = str(err.value)
    assert "speculative_config.method" in msg and "did you mean 'ngram'?" in msg
    assert all(repr(m) in msg for m in SPECULATIVE_METHODS)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"sampling": {"top_k": 1.5}}, "sampling.top_k"),
        ({"sampling": {"top_k": True}}, "sampling.top_k"),
        ({"sampling": {"ignore_eos": 1}}, "sampling.ignore_eos"),
        ({"sampling": {"stop_token_ids": "abc"}}, "sampling.stop_token_ids"),
        ({"sampling": 3}, "sampling"),
        ({"prompts": ["a", 2]}, "prompts[1]"),
        ({"model": {"model": 5}}, "model.model"),
    ],
)
def test_wrong_type_names_field(data, field):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, data)
    assert str(err.value).startswith(f"invalid {field}="), str(err.value)


def test_direct_construction_is_validated_and_canonicalized():
    with pytest.raises(ConfigError, match=r"^invalid temperature=-0\.5"):
        SamplingParams(temperature=-0.5)
    sp = SamplingParams(temperature=1, stop_token_ids=[5, 6])
    assert sp.temperature == 1.0 and isinstance(sp.temperature, float)
    assert sp.stop_token_ids == (5, 6)
    run = RunConfig(sampling={"temperature": 0.3}, prompts=["hi"])
    assert run.sampling == SamplingParams(temperature=0.3) and run.prompts == ("hi",)


# ------------------------------------------------------------------------------------------------ overrides


def test_overrides_parse_scalars_lists_and_null():
    base = load_run_config("methods/eagle")
    cfg = apply_overrides(base, [
        "sampling.max_new_tokens=64",
        "sampling.temperature=0.7",
        "sampling.top_p=1",
        "sampling.ignore_eos=true",
        "sampling.stop_token_ids=[2, 7]",
        "speculative.adaptive=false",
        "speculative.tree_choices=[[0], [0, 1]]",
        "speculative.typical_posterior_threshold=1e-2",
        "model.max_context=null",
        "batch_size=4",
        "prompts=[hello, world]",
    ])
    assert cfg.sampling.max_new_tokens == 64
    assert cfg.sampling.temperature == 0.7
    assert cfg.sampling.top_p == 1.0 and isinstance(cfg.sampling.top_p, float)
    assert cfg.sampling.ignore_eos is True
    assert cfg.sampling.stop_token_ids == (2, 7)
    assert cfg.speculative.adaptive is False
    assert cfg.speculative.tree_choices == ((0,), (0, 1))
    assert cfg.speculative.typical_posterior_threshold == 0.01
    assert cfg.model.max_context is None
    assert cfg.batch_size == 4 and cfg.prompts == ("hello", "world")
    # Untouched fields keep the base values.
    assert cfg.speculative.method == "eagle" and cfg.speculative.model == base.speculative.model
    hash(cfg)


def test_overrides_none_method_string_and_order():
    cfg = apply_overrides(RunConfig(), ["speculative.method=ngram", "speculative.prompt_lookup_max=5"])
    assert cfg.speculative.method == "ngram" and cfg.speculative.prompt_lookup_max == 5
    cfg = apply_overrides(cfg, ["speculative.method=None"])
    assert cfg.speculative.method is None
    # A string field keeps the raw text even when YAML would read a number.
    assert apply_overrides(RunConfig(), ["model.model=123"]).model.model == "123"
    # Later overrides win; the alias max_tokens replaces max_new_tokens.
    cfg = apply_overrides(RunConfig(), ["sampling.max_new_tokens=10", "sampling.max_tokens=20"])
    assert cfg.sampling.max_new_tokens == 20
    assert apply_overrides(RunConfig(), ["sampling={temperature: 0.2, top_k: 5}"]).sampling.top_k == 5


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("sampling.temprature=1", r"unknown key 'temprature' in sampling \(did you mean 'temperature'\?\)"),
        ("samplng.top_k=1", r"unknown key 'samplng' in RunConfig \(did you mean 'sampling'\?\)"),
        ("speculative.metod=ngram", r"unknown key 'metod' in speculative \(did you mean 'method'\?\)"),
        ("sampling.temperature.x=1", r"sampling\.temperature is a value, not a section"),
        ("sampling.temperature", r"must look like key\.path=value"),
        ("=3", r"empty key"),
        ("sampling.temperature=-1", r"^invalid sampling\.temperature=-1\.0"),
        ("speculative.method=ngrm", r"did you mean 'ngram'"),
    ],
)
def test_bad_overrides(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        apply_overrides(RunConfig(), [override])


def test_overrides_reject_single_string():
    with pytest.raises(ConfigError, match="list"):
        apply_overrides(RunConfig(), "sampling.top_k=1")


# ------------------------------------------------------------------------------------------------ round trip, hash


def test_round_trip_rich_config():
    cfg = RunConfig(
        model=ModelConfig(dtype="bfloat16", max_context=2048),
        sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=3, stop_token_ids=(1, 2)),
        speculative=SpeculativeConfig(method="medusa", model="heads", tree_choices=((0,), (1,), (0, 0)),
                                      acceptance="typical"),
        backend=BackendConfig(backend="cpu", attention_impl="reference"),
        batch_size=2,
        prompts=("a", "b"),
    )
    d = to_dict(cfg)
    assert d["speculative"]["tree_choices"] == [[0], [1], [0, 0]]  # lists, so yaml.safe_dump works
    assert from_dict(RunConfig, d) == cfg
    assert from_dict(RunConfig, yaml.safe_load(to_yaml(cfg))) == cfg
    assert to_dict(from_dict(RunConfig, d)) == d


def test_configs_are_hashable_and_equal_by_value():
    a = from_dict(RunConfig, {"sampling": {"stop_token_ids": [1, 2]}, "speculative": {"tree_choices": [[0]]}})
    b = from_dict(RunConfig, {"sampling": {"stop_token_ids": [1, 2]}, "speculative": {"tree_choices": [[0]]}})
    assert a == b and hash(a) == hash(b)
    assert len({a, b, RunConfig()}) == 2
    assert isinstance(a.sampling.stop_token_ids, tuple)
    assert isinstance(a.speculative.tree_choices[0], tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.batch_size = 3


def test_merge_is_deep_and_validated():
    cfg = merge(RunConfig(), {"sampling": {"top_k": 4}, "speculative": {"method": "ngram"}})
    assert cfg.sampling.top_k == 4 and cfg.sampling.max_new_tokens == 128
    assert cfg.speculative.method == "ngram"
    assert merge(cfg, {"sampling": {"max_tokens": 9}}).sampling.max_new_tokens == 9
    with pytest.raises(ConfigError, match=r"invalid sampling\.top_k=-2"):
        merge(cfg, {"sampling": {"top_k": -2}})
    with pytest.raises(ConfigError, match="did you mean 'sampling'"):
        merge(cfg, {"sampleing": {}})


# ------------------------------------------------------------------------------------------------ user-facing API


def test_vllm_style_speculative_dict():
    spec = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4)
    assert SpeculativeConfig.from_user(None) == SpeculativeConfig() and not SpeculativeConfig().enabled
    assert SpeculativeConfig.from_user(spec) is spec
    assert SpeculativeConfig.from_user({"method": "eagle3", "model": "heads/e3"}).model == "heads/e3"
    with pytest.raises(ConfigError, match=r"unknown key 'num_spec_tokens' in speculative_config"):
        SpeculativeConfig.from_user({"method": "ngram", "num_spec_tokens": 4})
    with pytest.raises(ConfigError, match="must be None, a dict or SpeculativeConfig"):
        SpeculativeConfig.from_user("ngram")


def test_is_lossy_only_for_typical_acceptance():
    assert not SpeculativeConfig(method="medusa", model="h").is_lossy
    typical = SpeculativeConfig(method="medusa", model="h", acceptance="typical")
    assert typical.is_lossy
    # Choosing typical acceptance changes nothing else.
    assert dataclasses.replace(typical, acceptance="lossless") == SpeculativeConfig(method="medusa", model="h")


def test_vllm_style_sampling_params():
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)
    assert sp.max_new_tokens == 64 and sp.temperature == 0.7 and sp.top_p == 0.9
    assert dataclasses.replace(sp, top_k=5).max_new_tokens == 64
    assert SamplingParams.from_user({"max_tokens": 8}).max_new_tokens == 8
    assert SamplingParams.from_user(None) == SamplingParams()
    with pytest.raises(ConfigError, match="conflicts with max_new_tokens=10"):
        SamplingParams(max_new_tokens=10, max_tokens=5)
    with pytest.raises(ConfigError, match="given twice"):
        from_dict(SamplingParams, {"max_new_tokens": 10, "max_tokens": 5})


# ------------------------------------------------------------------------------------------------ generic machinery


@dataclass(frozen=True)
class _Leaf:
    name: str
    size: int = 1


@dataclass(frozen=True)
class _Generic:
    leaf: _Leaf
    scale: Optional[float] = None
    mode: Literal["a", "b"] = "a"
    either: Union[int, str] = 0
    pair: tuple[int, str] = (0, "")
    items: list[int] = dataclasses.field(default_factory=tuple)
    maybe_leaf: Optional[_Leaf] = None


def test_generic_types_are_checked_and_coerced():
    g = from_dict(_Generic, {"leaf": {"name": "x"}, "scale": 2, "mode": "b", "either": "s",
                             "pair": [3, "q"], "items": [1, 2], "maybe_leaf": {"name": "y", "size": 3}})
    assert g.leaf == _Leaf("x") and g.scale == 2.0 and g.mode == "b" and g.either == "s"
    assert g.pair == (3, "q") and g.items == (1, 2) and g.maybe_leaf == _Leaf("y", 3)
    assert to_dict(g)["maybe_leaf"] == {"name": "y", "size": 3}
    assert from_dict(_Generic, to_dict(g)) == g


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({}, r"missing required key 'leaf' in _Generic"),
        ({"leaf": {}}, r"missing required key 'name' in leaf"),
        ({"leaf": {"name": "x"}, "mode": "c"}, r"invalid mode='c': must be one of 'a', 'b'"),
        ({"leaf": {"name": "x"}, "either": 1.5}, r"invalid either=1\.5"),
        ({"leaf": {"name": "x"}, "pair": [1]}, r"invalid pair=\[1\]: expected a list of exactly 2 items"),
        ({"leaf": {"name": "x"}, "pair": [1, 2]}, r"invalid pair\[1\]=2"),
        ({"leaf": {"name": "x"}, "scale": "big"}, r"invalid scale='big'"),
        ({"leaf": {"name": "x"}, "maybe_leaf": {"nme": "y"}}, r"unknown key 'nme' in maybe_leaf"),
        ({"leaf": {"name": "x"}, 3: 1}, r"unknown key '3' in _Generic"),
    ],
)
def test_generic_errors(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        from_dict(_Generic, data)


# ------------------------------------------------------------------------------------------------ files


def test_include_overrides_base(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text("sampling:\n  temperature: 0.5\n  top_k: 3\nbatch_size: 2\n")
    (tmp_path / "sub" / "child.yaml").write_text("include: ../base.yaml\nsampling:\n  top_k: 7\n")
    cfg = load_yaml(RunConfig, tmp_path / "sub" / "child.yaml")
    assert cfg.sampling.temperature == 0.5 and cfg.sampling.top_k == 7 and cfg.batch_size == 2


def test_include_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_yaml(RunConfig, tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("include: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml' does not exist"):
        load_yaml(RunConfig, tmp_path / "c.yaml")


def test_load_yaml_file_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml' does not exist"):
        load_yaml(RunConfig, tmp_path / "nope.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: top level must be a mapping"):
        load_yaml(RunConfig, listy)
    broken = tmp_path / "broken.yaml"
    broken.write_text("sampling: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:\d+:\d+: invalid YAML"):
        load_yaml(RunConfig, broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_yaml(RunConfig, empty) == RunConfig()


def test_load_yaml_uses_safe_load(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("prompts: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_yaml(RunConfig, evil)


def test_packaged_config_path_resolution(tmp_path):
    a = packaged_config_path("methods/ngram")
    assert a == packaged_config_path("methods/ngram.yaml") and a.name == "ngram.yaml" and a.is_file()
    own = tmp_path / "mine.yaml"
    own.write_text("batch_size: 3\n")
    assert packaged_config_path(str(own)) == own
    assert load_run_config(own).batch_size == 3
    with pytest.raises(ConfigError) as err:
        packaged_config_path("methods/ngrm")
    assert "did you mean 'methods/ngram'?" in str(err.value) and "methods/eagle3" in str(err.value)
    with pytest.raises(ConfigError, match="no config named"):
        packaged_config_path("../pyproject.toml")


# ------------------------------------------------------------------------------------------------ training configs


def test_every_training_kind_has_a_config():
    kinds = {load_yaml_dict(p)["train"]["kind"] for p in TRAIN_YAML_FILES}
    assert kinds == {"draft", "medusa", "eagle", "eagle3"}
    assert {"draft", "medusa", "eagle", "eagle3"} <= {p.stem for p in TRAIN_YAML_FILES}


@pytest.mark.parametrize("path", TRAIN_YAML_FILES, ids=lambda p: p.name)
def test_every_training_yaml_parses_into_its_trainer(path):
    """Every key of a training YAML is an option of its trainer, and the trainer's own parser accepts the argv."""
    import importlib

    from specjax.train.launch import main as launch, to_argv

    module_name, argv = to_argv(load_yaml_dict(path)["train"])
    args = importlib.import_module(module_name).parse_args(argv)
    assert args.out.startswith("runs/")
    name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
    command = launch(name, ["steps=7"], dry_run=True)
    assert command.startswith(f"python -m {module_name} ") and "--steps 7" in command


def test_training_yaml_typo_suggests_the_option():
    from specjax.train.launch import to_argv

    with pytest.raises(ConfigError, match="did you mean 'draft_vocab'"):
        to_argv({"kind": "eagle3", "data": "x.npz", "out": "o", "draft_vocb": 100})
    with pytest.raises(ConfigError, match="did you mean 'eagle3'"):
        to_argv({"kind": "eagle_3", "data": "x.npz", "out": "o"})
    with pytest.raises(ConfigError, match="true or false"):
        to_argv({"kind": "medusa", "data": ["x.npz"], "out": "o", "progress": "no"})


def test_train_head_cli_prints_the_command(capsys):
    from specjax.cli.main import main

    assert main(["train-head", "--config", "train/eagle", "--set", "steps=3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("python -m specjax.train.eagle --kind eagle") and "--steps 3" in out
    assert main(["train-head", "--config", "train/eagel"]) == 2
    assert "did you mean 'train/eagle'" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["train/eagle3", "train/eagle", "train/medusa", "train/draft"])
def test_train_head_without_its_data_names_it_and_leaves_no_run(config, tmp_path, capsys):
    from specjax.cli.main import main

    out, data = tmp_path / "run", tmp_path / "missing.npz"
    assert main(["train-head", "--config", config, "--set", f"out={out}", "--set", f"data={data}"]) != 0
    err = capsys.readouterr().err
    assert "missing.npz' does not exist" in err and "python -m specjax.train.data" in err
    assert "Traceback" not in err
    assert not out.exists()
