"""JobConfig in sections: every flag in one section, the flat edge (flags, API, JSON) round-trips,
structured flags are parsed once at construction, and --help / docs/cli.md group flags by section."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticdl import api, cli
from elasticdl.config import FLAGS, SECTIONS, ConfigError, JobConfig, parse_kv_params, render_kv_params
from elasticdl.config.kubernetes import Volume

REPO = Path(__file__).resolve().parent.parent

# A value other than the default for every flag (valid for --backend kubernetes too).
NON_DEFAULT = {
    "model_zoo": "zoo", "model_def": "pkg.mod.fn", "model_params": "units=[8, 4];act=relu;rate=0.5;t=(1,)",
    "minibatch_size": 32, "num_epochs": 3, "num_threads_per_process": 2, "embedding_swap_threshold_mb": 0.5,
    "embedding_admit_min_count": 2, "embedding_ttl_versions": 100, "embedding_max_rows": 1000,
    "slice_dense_above_mb": 8.0,
    "wire_dtype": "bfloat16", "tensor_transport": "tcp", "class_weight": "0:1.0,1:5.5",
    "training_data": "/data/train", "validation_data": "/data/val", "prediction_data": "/data/pred",
    "data_reader_params": "has_header=True", "num_minibatches_per_task": 4, "records_per_task": 100,
    "shuffle_seed": 7, "shuffle_tasks": False, "max_bad_records": 2, "stream_idle_secs": 30.0, "stream_start": "latest",
    "kafka_group": "lag-monitored", "export_every_secs": 60.0, "keep_exports": 3, "window_records": 1000,
    "keras_version": "2", "feed": "my_feed", "loss": "my_loss", "optimizer": "my_optimizer",
    "eval_metrics_fn": "my_metrics", "callbacks": "my_callbacks", "custom_data_reader": "my_reader",
    "prediction_outputs_processor": "MyProcessor",
    "evaluation_steps": 10, "evaluation_start_delay_secs": 1.5, "evaluation_throttle_secs": 2.5,
    "grads_to_wait": 2, "use_async": True, "staleness_bound": 3, "get_model_steps": 2, "push_steps": 4,
    "overlap_communication": True,
    "sync_version_tolerance": 1, "lr_staleness_modulation": True, "max_gradient_norm_ratio": 50.0,
    "num_workers": 4, "max_workers": 8, "num_ps": 2, "ps_replicas": 1, "worker_pod_priority": "0.5", "relaunch_on_worker_failure": 1,
    "task_timeout": 30.0, "max_task_retries": 1, "etcd_endpoints": "etcd-0:2379,etcd-1:2379",
    "checkpoint_dir": "/ckpt", "checkpoint_steps": 5, "keep_checkpoint_max": 0, "checkpoint_dir_for_init": "/init",
    "output": "/out", "prediction_outputs": "/preds", "tensorboard_log_dir": "/tb",
    "job_name": "sections-1", "backend": "kubernetes", "log_level": "DEBUG", "log_dir": "/logs",
    "image_name": "img:v1", "namespace": "ml", "image_pull_policy": "Never",
    "master_resource_request": "cpu=1,memory=1Gi", "master_resource_limit": "cpu=2,memory=2Gi",
    "worker_resource_request": "cpu=2,memory=4Gi,gpu=1", "worker_resource_limit": "cpu=4,memory=8Gi,gpu=1",
    "ps_resource_request": "cpu=1,memory=2Gi", "ps_resource_limit": "cpu=1,memory=3Gi",
    "master_pod_priority": "high", "ps_pod_priority": "my-class",
    "volume": "claim_name=data,mount_path=/data;host_path=/mnt,mount_path=/mnt,sub_path=x,read_only=true",
    "envs": "A=1,B=x=y", "cluster_spec": "spec.py", "yaml": "out.yaml", "detach": True,
}


# ---------------------------------------------------------------- every field in one section


def test_every_flag_is_in_exactly_one_section():
    seen: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            seen.setdefault(f.name, []).append(section)
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
    assert set(seen) == set(FLAGS)
    assert all(FLAGS[name].section == where[0] for name, where in seen.items())
    # the flags of the flat JobConfig, none lost or added; + --max_bad_records; + 8 model_zoo_functions; + --push_steps;
    # + --wire_dtype, --tensor_transport; + --overlap_communication; + --max_gradient_norm_ratio
    # + --stream_idle_secs, --stream_start; + --ps_replicas
    # + --class_weight; + --kafka_group, --export_every_secs, --keep_exports, --window_records
    # + --slice_dense_above_mb
    assert len(FLAGS) == 85


def test_jobconfig_holds_only_the_sections():
    assert [f.name for f in dataclasses.fields(JobConfig)] == list(SECTIONS)
    config = JobConfig()
    for section, cls in SECTIONS.items():
        assert type(getattr(config, section)) is cls
        assert cls.TITLE and cls.__doc__


def test_every_flag_has_help_commands_and_a_command_line_type():
    for f in FLAGS.values():
        assert f.help and f.commands, f.name
        assert f.kind in (str, int, float, bool), f.name
        assert (f.parse is None) == (f.render is None), f.name
        if f.parse is not None:  # a structured flag: text on the command line, its default too
            assert f.kind is str and isinstance(f.default, str), f.name


def test_non_default_covers_every_flag():
    assert set(NON_DEFAULT) == set(FLAGS)
    defaults = JobConfig()
    config = JobConfig.from_flags(**NON_DEFAULT)
    for name in FLAGS:
        assert config.flag_value(name) != defaults.flag_value(name), name


# ---------------------------------------------------------------- the flat edge


def test_flat_flags_config_json_round_trip():
    config = JobConfig.from_flags(**NON_DEFAULT)
    assert JobConfig.from_flags(**config.to_flags()) == config
    assert JobConfig.from_json(config.to_json()) == config
    assert JobConfig.from_json(JobConfig().to_json()) == JobConfig()
    # The JSON is the flags, as typed on the command line, nested by section.
    data = json.loads(config.to_json())
    assert list(data) == list(SECTIONS)
    assert data["consistency"]["use_async"] is True and data["training"]["minibatch_size"] == 32
    assert data["kubernetes"]["envs"] == "A=1,B=x=y"
    assert data["elasticity"]["worker_pod_priority"] == "0.5"
    flat = {name: value for section in data.values() for name, value in section.items()}
    assert flat == config.to_flags()


def test_the_command_line_the_api_and_from_flags_build_the_same_config():
    argv = ["train"]
    for name, value in NON_DEFAULT.items():
        if "train" in FLAGS[name].commands:
            argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    command, from_cli = cli.config_from_args(argv)
    train_flags = {n: v for n, v in NON_DEFAULT.items() if "train" in FLAGS[n].commands}
    assert command == "train"
    assert from_cli == api.make_config(**train_flags) == JobConfig.from_flags(**train_flags).with_defaults()


def test_unknown_flags_keep_their_error():
    for build in (JobConfig.from_flags, api.make_config, JobConfig().replace):
        with pytest.raises(ConfigError) as info:
            build(model_zoo="zoo", num_pss=2, batch_size=3)
        assert str(info.value).splitlines() == [
            "unknown option(s) batch_size, num_pss; see `elasticdl train --help` for the list.",
            "batch_size: did you mean minibatch_size? (Keras's batch_size)",
            "num_pss: did you mean num_ps?",
        ]


def test_from_json_refuses_what_is_not_a_section_or_is_in_the_wrong_one():
    with pytest.raises(ConfigError, match="unknown section 'trainin'"):
        JobConfig.from_json('{"trainin": {"minibatch_size": 1}}')
    with pytest.raises(ConfigError, match="minibatch_size in 'data'; it belongs to 'training'"):
        JobConfig.from_json('{"data": {"minibatch_size": 1}}')
    with pytest.raises(ConfigError, match="unknown option"):
        JobConfig.from_json('{"data": {"no_such_flag": 1}}')


def test_replace_takes_flags_and_leaves_the_original_alone():
    config = JobConfig.from_flags(envs="A=1", num_ps=2)
    changed = config.replace(envs="B=2", checkpoint_dir_for_init="/ckpt")
    assert changed.kubernetes.envs == {"B": "2"} and changed.checkpoints.checkpoint_dir_for_init == "/ckpt"
    assert changed.elasticity.num_ps == 2
    assert config.kubernetes.envs == {"A": "1"} and config.checkpoints.checkpoint_dir_for_init == ""
    changed.elasticity.num_ps = 5  # a deep copy: no section is shared
    assert config.elasticity.num_ps == 2


def test_with_defaults_does_not_touch_the_original():
    config = JobConfig.from_flags(model_def="a.b.c", log_level="debug")
    filled = config.with_defaults()
    assert filled.job.log_level == "DEBUG" and filled.job.job_name.startswith("elasticdl-a-")
    assert config.job.log_level == "debug" and config.job.job_name == "" and config.outputs.prediction_outputs == ""


# ---------------------------------------------------------------- structured flags, parsed once


def test_structured_flags_are_typed_values():
    c = JobConfig.from_flags(**NON_DEFAULT)
    assert c.training.model_params == {"units": [8, 4], "act": "relu", "rate": 0.5, "t": (1,)}
    assert c.data.data_reader_params == {"has_header": True} and c.data.has_header is True
    assert c.kubernetes.envs == {"A": "1", "B": "x=y"}
    assert c.kubernetes.worker_resource_request == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}
    assert c.kubernetes.resources("worker") == (
        {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}, {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}
    )
    assert c.kubernetes.volume == [
        Volume("/data", claim_name="data"), Volume("/mnt", host_path="/mnt", sub_path="x", read_only=True)
    ]
    assert c.elasticity.worker_pod_priority == 0.5
    assert c.elasticity.etcd_endpoints == ["etcd-0:2379", "etcd-1:2379"]
    defaults = JobConfig()
    assert defaults.training.model_params == {} and defaults.kubernetes.volume == []
    assert defaults.elasticity.worker_pod_priority == 1.0 and defaults.elasticity.etcd_endpoints == []
    assert defaults.kubernetes.resources("ps") == ({"cpu": "1", "memory": "4096Mi"},) * 2  # no limit: the requests
    assert JobConfig.from_flags(worker_pod_priority="LOW").elasticity.worker_pod_priority == 0.0


def test_structured_flags_take_their_typed_value_too():
    c = JobConfig.from_flags(model_params={"a": 1, "b": "x"}, envs={"A": "1"}, worker_pod_priority=0.25,
                             volume=[Volume("/d", claim_name="c")], etcd_endpoints=["e:1"])
    assert c == JobConfig.from_flags(model_params="a=1;b='x'", envs="A=1", worker_pod_priority="0.25",
                                     volume="claim_name=c,mount_path=/d", etcd_endpoints="e:1")
    with pytest.raises(ConfigError, match="--worker_pod_priority must be high, low or a fraction"):
        JobConfig.from_flags(worker_pod_priority=2)
    with pytest.raises(ConfigError, match="--envs takes text like"):
        JobConfig.from_flags(envs=42)


BAD_STRUCTURED = [
    ({"model_params": "hidden_units"}, "--model_params must look like \"a=1;b=2.5;c='x'\". Cannot parse 'hidden_units'"),
    ({"data_reader_params": "=1"}, "--data_reader_params must look like"),
    ({"worker_pod_priority": "medium"},
     "--worker_pod_priority must be high, low or a fraction between 0 and 1. Received: 'medium'"),
    ({"worker_resource_request": "cpu=one"}, "--worker_resource_request: 'one' for cpu in 'cpu=one' is not a Kubernetes quantity"),
    ({"ps_resource_limit": "memory"}, "--ps_resource_limit: cannot parse 'memory' in 'memory'; expected the form"),
    ({"volume": "mount_path=/d"}, "--volume: 'mount_path=/d' needs exactly one of claim_name= or host_path="),
    ({"envs": "1A=2"}, "--envs: cannot parse '1A=2' in '1A=2'; expected NAME=value,NAME2=value2"),
    ({"etcd_endpoints": " , "}, "--etcd_endpoints names no endpoint"),
]


@pytest.mark.parametrize("flags, message", BAD_STRUCTURED, ids=[next(iter(f)) for f, _ in BAD_STRUCTURED])
def test_bad_structured_flags_fail_at_construction_with_the_flag_and_the_fix(flags, message):
    for build in (JobConfig.from_flags, api.make_config, JobConfig().replace):
        with pytest.raises(ConfigError) as info:
            build(**flags)
        assert message in str(info.value)


def test_a_bad_structured_flag_on_the_command_line_is_one_line_and_exit_2(capsys):
    assert cli.main(["train", "--model_params", "hidden_units"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elasticdl train: error: --model_params must look like") and err.count("\n") == 1


# The parsers of structured flags; only elasticdl/config/ may call them.
PARSERS = {"parse_kv_params", "parse_resources", "parse_volumes", "parse_envs", "parse_priority_spec"}


def test_structured_flags_are_parsed_only_in_the_config_package():
    calls = []
    for path in sorted((REPO / "elasticdl").rglob("*.py")):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
                if name in PARSERS:
                    calls.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert calls == [], "read the typed value of the config's section instead of parsing the flag again"


def test_users_read_the_typed_values():
    """Manifests, PS settings and the worker's policy come from the sections' typed values."""
    from elasticdl.launch.kubernetes import manifests
    from elasticdl.ps.main import settings_from_config
    from elasticdl.worker.consistency import ConsistencyPolicy

    config = JobConfig.from_flags(**NON_DEFAULT)
    config.kubernetes.envs["EXTRA"] = "1"  # the typed value is what the manifests use
    spec = manifests.role_spec(config, "worker", None)
    assert spec.requests["nvidia.com/gpu"] == "1"
    plan = manifests.PodPlan("worker", 0, ["python"], ["-m", "x"])
    pod = manifests.pod_manifest(config, plan, spec)
    # --envs values live in the job's Secret; the pod refers to them by key.
    env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}).get("key") for e in pod["spec"]["containers"][0]["env"]}
    assert env["EXTRA"] == manifests.env_secret_key("EXTRA") and env["B"] == manifests.env_secret_key("B")
    secret = manifests.secret_manifest(config, "token", None)["stringData"]
    assert secret[manifests.env_secret_key("EXTRA")] == "1" and secret[manifests.env_secret_key("B")] == "x=y"
    assert len(pod["spec"]["volumes"]) == 3  # the token and the two --volume entries
    settings = settings_from_config(config, 1)
    assert (settings.num_ps, settings.grads_to_wait, settings.checkpoint_dir) == (2, 2, "/ckpt")
    policy = ConsistencyPolicy.from_config(config, num_ps=2)
    assert (policy.use_async, policy.staleness_bound, policy.get_model_steps) == (True, 3, 2)


# key=value params: the text the JSON carries parses back to the same values. (Values hold no
# ';', which separates the params: parsing never makes one.)
_literals = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(alphabet="abc xyz_-/.=")
    | st.binary(max_size=4).filter(lambda b: b";" not in b),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner) | st.tuples(inner, inner)
    | st.dictionaries(st.integers() | st.text(alphabet="abc", max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), _literals, max_size=4))
def test_kv_params_render_parses_back(params):
    text = render_kv_params(params)
    back = parse_kv_params(text, "--model_params")
    assert back == params and _types(back) == _types(params)


def _types(value):
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return (type(value), [_types(v) for v in value])
    return type(value)


def test_kv_params_infinity_and_bare_words_survive_the_json():
    config = JobConfig.from_flags(model_params="big=1e999;small=-1e999;act=relu;path=/data/x=y;odd={[]: 1}")
    back = JobConfig.from_json(config.to_json()).training.model_params
    assert back == {"big": math.inf, "small": -math.inf, "act": "relu", "path": "/data/x=y", "odd": "{[]: 1}"}


# ---------------------------------------------------------------- --help and docs/cli.md


def _help(command: str) -> str:
    sub = next(a for a in cli.build_parser()._actions if a.choices and command in a.choices).choices[command]
    return sub.format_help()


def test_help_groups_the_flags_under_their_section_titles():
    text = _help("train")
    positions = []
    for section, cls in SECTIONS.items():
        flags = [f for f in FLAGS.values() if f.section == section and "train" in f.commands]
        assert f"\n{cls.TITLE}:\n" in text, cls.TITLE
        start = text.index(f"\n{cls.TITLE}:\n")
        positions.append(start)
        for f in flags:  # each flag after its own title and before the next section's
            assert text.index(f"  {f.option} ", start) > start
    assert positions == sorted(positions)
    for title in ("Consistency", "Evaluation"):  # sections without evaluate flags are left out
        assert f"\n{title}:\n" not in _help("predict")


def test_cli_reference_lists_flags_under_section_headings():
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    train = text[text.index("## elasticdl train"):text.index("## elasticdl evaluate")]
    tables = {chunk.split("\n", 1)[0]: chunk for chunk in train.split("\n### ")[1:]}
    assert list(tables) == [cls.TITLE for cls in SECTIONS.values()]
    for f in FLAGS.values():
        if "train" in f.commands:
            assert f"| `{f.option}`" in tables[SECTIONS[f.section].TITLE], f.name
