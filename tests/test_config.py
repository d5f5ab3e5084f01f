"""Experiment configs: validation messages, overrides, digests, every shipped YAML loads."""

import dataclasses
import itertools
from pathlib import Path

import pytest
import yaml

from zeroth import config as C

# `zeroth run` configs of zeroth.config: YAML files whose top-level keys are config sections (the
# Marsit configs, with a top-level `runs` list, have their own schema: tests/test_marsit_experiments.py).
EXPERIMENTS = [
    p
    for p in sorted((Path(__file__).resolve().parent.parent / "experiments").glob("*.yaml"))
    if set(yaml.safe_load(p.read_text()) or {}) <= set(C.SECTIONS)
]


def test_defaults_are_valid_and_frozen():
    cfg = C.load_config_dict({})
    assert cfg.train.method == "zo" and cfg.peers is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_unknown_top_level_key_names_it_and_the_valid_sections():
    with pytest.raises(ValueError) as e:
        C.load_config_dict({"trian": {}})
    msg = str(e.value)
    assert "'trian'" in msg and "top level" in msg
    for section in C.SECTIONS:
        assert section in msg


def test_unknown_key_in_section_names_key_section_and_valid_keys():
    with pytest.raises(ValueError) as e:
        C.load_config_dict({"train": {"learning_rate": 0.1}})
    msg = str(e.value)
    assert "'learning_rate'" in msg and "'train'" in msg
    assert "'lr'" in msg and "'n_perturbations'" in msg


def test_unknown_key_in_nested_section():
    with pytest.raises(ValueError, match=r"'beta1'.*'train.optimizer'.*'b1'"):
        C.load_config_dict({"train": {"optimizer": {"beta1": 0.9}}})


def test_unknown_key_in_peers_section():
    with pytest.raises(ValueError, match=r"'ports'.*'peers'.*'base_port'"):
        C.load_config_dict({"peers": {"ports": 3}})


@pytest.mark.parametrize(
    "raw, field, valid",
    [
        ({"train": {"method": "adam"}}, "train.method", "['zo', 'backprop']"),
        ({"train": {"lr": -1.0}}, "train.lr", "> 0.0"),
        ({"train": {"steps": "many"}}, "train.steps", "an integer"),
        ({"train": {"steps": 0}}, "train.steps", ">= 1"),
        ({"train": {"codec": "twobyte"}}, "train.codec", "'onebyte'"),
        ({"train": {"distribution": "gaussian"}}, "train.distribution", "'binomial'"),
        ({"train": {"requantize": "up"}}, "train.requantize", "['nearest', 'stochastic']"),
        ({"train": {"eps": "tiny"}}, "train.eps", "a number"),
        ({"run": {"seed": 2**32}}, "run.seed", "<= 4294967295"),
        ({"data": {"dataset": "imagenet"}}, "data.dataset", "'digits'"),
        ({"model": {"name": "resnet"}}, "model.name", "'mlp'"),
        ({"model": {"kwargs": [1, 2]}}, "model.kwargs", "a mapping"),
        ({"peers": {"count": 0}}, "peers.count", ">= 1"),
        ({"peers": {"tls": "yes"}}, "peers.tls", "true or false"),
        ({"peers": {"join_at": 3}}, "peers.join_at", "a list of int"),
        ({"peers": {"join_at": [1, "x"]}}, "peers.join_at[1]", "an integer"),
        ({"peers": {"base_port": 70000}}, "peers.base_port", "<= 65535"),
    ],
)
def test_bad_values_name_field_value_and_what_is_valid(raw, field, valid):
    with pytest.raises(ValueError) as e:
        C.load_config_dict(raw)
    msg = str(e.value)
    assert field in msg, msg
    value = next(iter(next(iter(raw.values())).values()))
    if field.endswith("]"):  # an element is named: the first bad one
        value = next(v for v in value if not isinstance(v, int))
    assert repr(value) in msg, msg
    assert valid in msg, msg


def test_yaml_1_1_exponent_strings_are_numbers():
    cfg = C.load_config_dict(yaml.safe_load("train: {eps: 1e-3, lr: 2e-2}"))
    assert cfg.train.eps == 1e-3 and cfg.train.lr == 2e-2


def test_backprop_refuses_a_non_differentiable_objective():
    with pytest.raises(ValueError, match="error_rate.*not differentiable"):
        C.load_config_dict({"train": {"method": "backprop", "objective": "error_rate"}})


def test_overrides_parse_yaml_values():
    cfg = C.load_config_dict(
        {"model": {"name": "mlp", "kwargs": {"hidden": [64]}}},
        ["train.lr=0.5", "train.codec=float32", "model.kwargs.hidden=[8, 4]", "run.out_dir=null"],
    )
    assert cfg.train.lr == 0.5 and cfg.train.codec == "float32"
    assert cfg.model.kwargs == {"hidden": [8, 4]} and cfg.run.out_dir is None


def test_override_creates_peers_section_with_defaults():
    cfg = C.load_config_dict({}, ["peers.count=3", "peers.join_at=[2, 5]", "peers.token=s3cret"])
    assert cfg.peers is not None
    assert (cfg.peers.count, cfg.peers.join_at, cfg.peers.token) == (3, (2, 5), "s3cret")
    assert cfg.peers.host == "127.0.0.1" and cfg.peers.base_port == 0 and cfg.peers.tls is False


def test_peers_needs_zo():
    with pytest.raises(ValueError, match="peers.*zo"):
        C.load_config_dict({"train": {"method": "backprop"}, "peers": {}})


def test_bad_overrides_are_named():
    with pytest.raises(ValueError, match=r"'lrr'.*'train'"):
        C.load_config_dict({}, ["train.lrr=1"])
    with pytest.raises(ValueError, match="section.field=value"):
        C.load_config_dict({}, ["train.lr"])
    with pytest.raises(ValueError, match="must name a section and a field"):
        C.load_config_dict({}, ["lr=1"])
    with pytest.raises(ValueError, match=r"train\.lr.*'abc'"):
        C.apply_overrides(C.load_config_dict({}), ["train.lr=abc"])


def test_yaml_round_trip_and_digest():
    cfg = C.load_config_dict({"train": {"steps": 7}}, ["peers.count=2"])
    again = C.load_config_dict(yaml.safe_load(C.to_yaml(cfg)))
    assert again == cfg
    assert C.config_digest(again) == C.config_digest(cfg)
    changed = C.apply_overrides(cfg, ["train.lr=0.25"])
    assert C.config_digest(changed) != C.config_digest(cfg)
    assert C.diff(cfg, changed) == ["train.lr"]
    assert C.config_digest(changed, exclude=["train.lr"]) == C.config_digest(cfg, exclude=["train.lr"])
    assert len(C.config_digest(cfg)) == 64


def test_every_field_has_help_and_describe_lists_it():
    text = C.describe()

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help"
            inner = cls.__dataclass_fields__[f.name].type
            sub = {
                "RunConfig": C.RunConfig,
                "DataConfig": C.DataConfig,
                "ModelConfig": C.ModelConfig,
                "TrainConfig": C.TrainConfig,
                "OptimizerConfig": C.OptimizerConfig,
                "PeersConfig": C.PeersConfig,
                "BinaryConfig": C.BinaryConfig,
                "PipelineConfig": C.PipelineConfig,
                "RavnestConfig": C.RavnestConfig,
            }
            name = next((k for k in sub if k in str(inner)), None)
            if name:
                walk(sub[name], f"{prefix}{f.name}.")
            else:
                assert f"{prefix}{f.name} (" in text

    walk(C.Config, "")


def test_load_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        C.load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        C.load_config(lst)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_shipped_experiments_load(path):
    cfg = C.load_config(path)
    assert C.diff(cfg, C.load_config_dict(yaml.safe_load(C.to_yaml(cfg)))) == []


def test_shipped_experiments_exist():
    names = {p.stem for p in EXPERIMENTS}
    assert {"mezo_digits", "backprop_digits", "mezo_mnist5k", "onebyte_vs_float32", "nondiff_accuracy"} <= names


def test_help_config_cli(capsys):
    from zeroth.run import main

    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "train.n_perturbations" in out and "peers.join_at" in out and "perturbations per step" in out
    marsit = out[out.index("A Marsit experiment") :]  # its own schema, required fields said so
    assert (
        "label (str, required)" in marsit
        and 'sync.method (str, default "psgd") [choices: ' in marsit
        and "sync.K " in marsit
    )


def test_config_choices_match_the_trainer_registries():
    from zeroth import methods, objectives

    assert set(C.OPTIMIZERS) == set(methods.OPTIMIZERS)
    assert set(C.OBJECTIVES) == set(objectives.OBJECTIVES)
    assert set(C.METHODS) == {"zo", "backprop"}


def test_zeroth_without_a_command_is_a_usage_error(capsys):
    from zeroth import cli

    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "no command given" in err and "commands:" in err
    assert cli.main(["--help"]) == 0 and "commands:" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


def test_a_quoted_number_is_refused_but_yaml_exponents_are_numbers():
    from zeroth import config as zc

    cfg = zc.apply_overrides(zc.Config(), ["train.lr=1e-3"])  # YAML 1.1 reads 1e-3 as a string
    assert cfg.train.lr == 0.001
    with pytest.raises(ValueError, match=r"train.lr: bad value '0.02'; expected a number, not a quoted string"):
        zc.apply_overrides(zc.Config(), ['train.lr="0.02"'])


def _bomb(levels: int = 12) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "run: {name: bomb}\nunknown_key:\n" + "\n".join("  " + line for line in lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once_in_one_line(tmp_path, capsys):
    import time

    from zeroth.run import main

    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb())  # 10**12 values once expanded, under a key that is not even valid
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        C.load_config(path)
    assert time.perf_counter() - t0 < 1.0
    msg = str(e.value)
    assert "\n" not in msg and "bomb.yaml" in msg and f"more than {C.MAX_YAML_NODES} values" in msg
    with pytest.raises(ValueError, match=r"override 'model.kwargs=.*more than"):
        C.load_config_dict({}, ["model.kwargs=" + "{" + _bomb().replace("\n", ", ").replace("  ", "")[:-2] + "}"])
    with pytest.raises(ValueError, match="recursive alias"):
        C.parse_yaml("a: &a [1, *a]", "x")
    with pytest.raises(ValueError, match=f"deeper than {C.MAX_YAML_DEPTH} levels"):
        C.parse_yaml("a: " + "[" * 40 + "]" * 40, "x")
    with pytest.raises(ValueError, match=f"deeper than {C.MAX_YAML_DEPTH} levels"):
        C.parse_yaml("[" * 5000 + "]" * 5000, "x")
    # `zeroth run` reads the file before anything else (is it a Marsit config?)
    t0 = time.perf_counter()
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    assert time.perf_counter() - t0 < 1.0 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than" in err
    # a few aliases, as a config may use them, still load
    assert C.parse_yaml("a: &w [64, 64]\nb: *w", "x") == {"a": [64, 64], "b": [64, 64]}


RAVNEST = {
    "data": {"dataset": "sentiment", "batch_size": 8},
    "model": {"name": "transformer"},
    "train": {"method": "backprop"},
}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"run": {"name": "../up"}}, "config field run.name: bad value '../up'"),
        ({"run": {"name": "/abs"}}, "config field run.name: bad value '/abs'"),
        (
            {**RAVNEST, "ravnest": {"clusters": 1, "nodes": [{"name": "..", "ram_mb": 4, "bandwidth_mbps": 1}]}},
            "config field ravnest.nodes[0].name: bad value '..'",
        ),
        (
            {**RAVNEST, "ravnest": {"clusters": 1, "nodes": [{"name": "/tmp/n0", "ram_mb": 4, "bandwidth_mbps": 1}]}},
            "config field ravnest.nodes[0].name: bad value '/tmp/n0'",
        ),
        (
            {
                **RAVNEST,
                "ravnest": {
                    "clusters": 1,
                    "nodes": [{"name": f"n{i}", "ram_mb": 4, "bandwidth_mbps": 1} for i in range(C.MAX_PROCESSES + 1)],
                },
            },
            f"config field ravnest.nodes: {C.MAX_PROCESSES + 1} nodes exceed MAX_PROCESSES={C.MAX_PROCESSES}",
        ),
        ({"peers": {"count": 1000}}, f"config field peers.count: bad value 1000; expected <= {C.MAX_PROCESSES}"),
        ({"peers": {"count": C.MAX_PROCESSES, "join_at": [3]}}, "config field peers.join_at:"),
        ({"binary": {"workers": 500}}, f"config field binary.workers: bad value 500; expected <= {C.MAX_PROCESSES}"),
        (
            {"data": {"batch_size": 10**12}},
            f"config field data.batch_size: bad value {10**12}; expected <= {C.MAX_BATCH}",
        ),
        ({"train": {"n_perturbations": 10**9}}, f"expected <= {C.MAX_PERTURBATIONS}"),
        (
            {"model": {"name": "mlp", "kwargs": {"hidden": [64, 10**9]}}},
            "config field model.kwargs.hidden[1]: bad value 1000000000",
        ),
        (
            {
                "run": {"name": "p"},
                "data": {"dataset": "sotu", "batch_size": 4},
                "model": {"name": "transformer"},
                "train": {"method": "backprop"},
                "pipeline": {"stages": 7, "examples": 8},
            },
            "config field pipeline.stages: 7 stages but model 'transformer' has 2 blocks; expected at most 2",
        ),
        (
            {
                "run": {"name": "p"},
                "data": {"dataset": "sotu", "batch_size": 4},
                "model": {"name": "transformer"},
                "train": {"method": "backprop"},
                "pipeline": {"stages": 100, "examples": 8},
            },
            f"config field pipeline.stages: bad value 100; expected <= {C.MAX_PROCESSES}",
        ),
    ],
)
def test_hostile_values_are_refused_in_one_line_naming_the_field(raw, message):
    with pytest.raises(ValueError) as e:
        C.load_config_dict(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_transformer_split_into_as_many_stages_as_blocks_is_accepted():
    raw = {
        "run": {"name": "p"},
        "data": {"dataset": "sotu", "batch_size": 4},
        "model": {"name": "transformer", "kwargs": {"layers": 7}},
        "train": {"method": "backprop"},
        "pipeline": {"stages": 7, "examples": 8},
    }
    assert C.load_config_dict(raw).pipeline.stages == 7


# The smallest valid config of each system: its section (the tag) and what it asks of the rest.
SYSTEM_CONFIGS = {
    "peers": {"peers": {"count": 3}},
    "pipeline": {
        "data": {"dataset": "sotu", "batch_size": 4},
        "model": {"name": "transformer"},
        "train": {"method": "backprop"},
        "pipeline": {"examples": 8},
    },
    "binary": {"binary": {"workers": 2}},
    "ravnest": {**RAVNEST, "ravnest": {"clusters": 1}},
}

SYSTEM_OVERRIDES = {
    "peers": "peers.count=2",
    "pipeline": "pipeline.stages=2",
    "binary": "binary.workers=1",
    "ravnest": "ravnest.clusters=1",
}


def test_each_system_section_decodes_by_its_tag_into_the_systems_own_dataclass():
    from zeroth.binary.config import BinaryConfig
    from zeroth.cluster.config import RavnestConfig
    from zeroth.net.config import PeersConfig
    from zeroth.pipeline.config import PipelineConfig

    owners = {"peers": PeersConfig, "pipeline": PipelineConfig, "binary": BinaryConfig, "ravnest": RavnestConfig}
    assert C.SYSTEMS == tuple(owners) and C.load_config_dict({}).system is None
    for tag, raw in SYSTEM_CONFIGS.items():
        cfg = C.load_config_dict(raw)
        assert cfg.system == tag and type(getattr(cfg, tag)) is owners[tag], tag
        assert [s for s in C.SYSTEMS if getattr(cfg, s) is not None] == [tag]
        assert C.load_config_dict(yaml.safe_load(C.to_yaml(cfg))) == cfg  # round trip keeps the tag
    assert C.load_config_dict(SYSTEM_CONFIGS["peers"]).peers.count == 3
    assert C.load_config_dict(SYSTEM_CONFIGS["binary"]).binary.workers == 2


@pytest.mark.parametrize("first, second", list(itertools.permutations(C.SYSTEMS, 2)))
def test_two_system_sections_are_refused_by_the_union_naming_both(first, second):
    raw = {**SYSTEM_CONFIGS[first], second: {}}
    with pytest.raises(ValueError) as e:
        C.load_config_dict(raw)
    msg = str(e.value)
    assert msg.startswith(f"config sections {first!r} and {second!r} cannot be combined: a config runs one system")
    assert msg.endswith("remove one of them") and str(list(C.SYSTEMS)) in msg and "\n" not in msg
    # a --set that creates a second system's section is refused the same way, and `null` is no section
    with pytest.raises(ValueError, match=f"config sections {first!r} and {second!r} cannot be combined"):
        C.load_config_dict(SYSTEM_CONFIGS[first], [SYSTEM_OVERRIDES[second]])
    assert C.load_config_dict({**SYSTEM_CONFIGS[first], second: None}).system == first


def test_three_system_sections_name_the_first_two_and_the_rest():
    with pytest.raises(ValueError, match=r"'peers' and 'binary' cannot be combined.*\(also set: \['pipeline'\]\)"):
        C.load_config_dict({"peers": {}, "binary": {}, "pipeline": {}})


def test_decoding_a_config_imports_no_system():
    """The systems' sections sit below the systems: loading any config leaves the systems unimported."""
    import subprocess
    import sys

    code = (
        "import sys; from zeroth import config; "
        f"[config.load_config_dict(raw) for raw in {list(SYSTEM_CONFIGS.values())!r}]; "
        "systems = ('zeroth.net.', 'zeroth.pipeline.', 'zeroth.cluster.', 'zeroth.binary.'); "
        "print(sorted(m for m in sys.modules if m.startswith(systems)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == str(
        ["zeroth.binary.config", "zeroth.cluster.config", "zeroth.net.config", "zeroth.pipeline.config"]
    )


@dataclasses.dataclass(frozen=True)
class _Shape:
    size: int = C.field(1, "Size.", min=1)


@dataclasses.dataclass(frozen=True)
class _Shapes:
    square: _Shape | None = C.field(None, "A square.", one_of="shape")
    circle: _Shape | None = C.field(None, "A circle.", one_of="shape")
    colour: str = C.field("red", "Not in the union.")


@dataclasses.dataclass(frozen=True)
class _Drawing:
    shapes: _Shapes = C.field(help="The shapes.", factory=_Shapes)


def test_a_schema_union_names_its_section_and_describe_lists_its_members():
    from zeroth import schema

    assert schema.build(_Drawing, {"shapes": {"circle": {"size": 2}, "colour": "blue"}}).shapes.circle.size == 2
    with pytest.raises(ValueError) as e:
        schema.build(_Drawing, {"shapes": {"circle": {}, "square": {}}})
    assert str(e.value) == (
        "config sections 'circle' and 'square' of section 'shapes' cannot be combined: a config runs one shape, "
        "named by its section (one of ['square', 'circle']); remove one of them"
    )
    text = schema.describe(_Drawing)
    assert "shapes.square:  A square. [one shape at most: square, circle]" in text
    assert "shapes.colour (str," in text and "[one shape" not in text.split("shapes.colour")[1]
    assert "peers:  Optional: run as several peers over loopback gRPC. [one system at most: " in C.describe()
