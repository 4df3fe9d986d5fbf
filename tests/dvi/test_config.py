"""The Hydra configs in conf/ against the typed config in dvi/config.py: every field can be set from the command
line, every config file composes into a valid config, and the checks across groups hold."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dvi.config import CONF_DIR, LR_TRAINED, LR_UNTRAINED, DviConfig, learning_rate, load_config
from dvi.errors import DviError

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "experiment")
PARTIAL = {"trigger"}  # each trigger file sets only the keys its kind reads (continuous: just the kind)


def fields_of(cls, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= fields_of(type(default), f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def keys_of(node, prefix: str = "") -> set[str]:
    out = set()
    for key, value in node.items():
        if OmegaConf.is_dict(value) and key not in ("security",):
            out |= keys_of(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out


@pytest.mark.parametrize("group", GROUPS)
def test_every_field_of_the_typed_config_is_in_every_file_of_its_group(group):
    """A field missing from the YAML cannot be set on the command line (Hydra's struct mode refuses `group.key=`)."""
    expected = fields_of(type(getattr(DviConfig(), group)))
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="config", overrides=[f"{group}={path.stem}"])
        found = keys_of(raw[group])
        assert found <= expected, f"conf/{group}/{path.name}: keys the typed config does not have: {sorted(found - expected)}"
        assert group in PARTIAL or found == expected, f"conf/{group}/{path.name}: missing {sorted(expected - found)}"
        load_config([f"{group}={path.stem}"])  # and it composes into a valid config


def test_experiments_compose():
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        load_config([f"+experiment={path.stem}"])


def test_checks_across_groups_name_both_values():
    with pytest.raises(DviError, match=r"stream.topk=16.*serve.spec.topk_logprobs=8"):
        load_config(["stream.topk=16"])
    assert load_config(["stream.topk=16", "serve.spec.topk_logprobs=16"]).stream.topk == 16


def test_a_poll_interval_shorter_than_the_session_is_refused_naming_both():
    with pytest.raises(DviError, match=r"stream.max_poll_interval_ms=5000.*>= stream.session_timeout_ms \(6000\)"):
        load_config(["stream.max_poll_interval_ms=5000"])
    assert load_config([]).stream.max_poll_interval_ms == 30 * 60 * 1000


@pytest.mark.parametrize("bad, why", [("0", r"stream.retention_hours=0.0: expected null \(keep every record\) or a number of hours in \(0, 1e6\)"),
                                      ("-1", r"stream.retention_hours=-1.0: expected null"),
                                      ("1e7", r"stream.retention_hours=10000000.0: expected null"),
                                      ("true", r"Value 'True' of type 'bool' could not be converted to Float"),
                                      ("'a week'", r"Value 'a week' of type 'str' could not be converted to Float")])
def test_a_retention_that_is_not_a_positive_number_of_hours_is_refused(bad, why):
    with pytest.raises(DviError, match=why):
        load_config([f"stream.retention_hours={bad}"])


@pytest.mark.parametrize("override, why", [
    ("stream.features.share=1.5", r"stream.features.share=1.5: expected a share of requests in \[0, 1\]"),
    ("stream.features.encoding=fp8", r"stream.features.encoding='fp8': expected bf16 or int8"),
    ("stream.features.max_tokens=0", r"stream.features.max_tokens=0: expected an integer >= 1"),
    ("trainer.features=target", r"trainer.features='target': expected auto, records or recompute"),
    ("trainer.gate_rule=greedy", r"trainer.gate_rule='greedy': expected auto, argmax or sampled"),
    ("trainer.precision=fp16", r"trainer.precision='fp16': expected auto, fp32, bf16 or bf16-mixed"),
    ("trainer.lr=0", r"trainer.lr=0: expected auto or a number > 0"),
    ("trainer.lr=fast", r"trainer.lr='fast': expected auto or a number > 0"),
    ("trainer.pause_share=1", r"trainer.pause_share=1.0: expected a number from 0 up to \(not including\) 1"),
    ("trainer.pause_share=-0.1", r"trainer.pause_share=-0.1: expected a number from 0"),
    ("trainer.pause_share_min=1", r"trainer.pause_share_min=1.0: expected a number from 0 up to \(not including\) 1"),
])
def test_features_and_the_trainers_new_settings_are_checked(override, why):
    with pytest.raises(DviError, match=why):
        load_config([override])


def test_the_learning_rate_is_auto_by_the_starting_drafter_or_as_given():
    lr = load_config().trainer.lr
    assert lr == "auto" and learning_rate(lr, untrained=True) == LR_UNTRAINED == 3e-4
    assert learning_rate(lr, untrained=False) == LR_TRAINED < LR_UNTRAINED
    assert learning_rate(load_config(["trainer.lr=5e-4"]).trainer.lr, untrained=False) == 5e-4


def test_the_retired_engine_is_one_error_naming_its_replacement():
    """serve.engine=vllm (vLLM's engine inside dvi's own HTTP server) is gone: one error at load names vllm-server and
    dvi; the engines left load, and an unknown one lists them."""
    with pytest.raises(DviError, match=r"serve.engine=vllm .*is retired: serve.engine=vllm-server .*serve.engine=dvi$"):
        load_config(["serve.engine=vllm"])
    assert [load_config([f"serve.engine={e}"]).serve.engine for e in ("auto", "dvi", "vllm-server")] == ["auto", "dvi", "vllm-server"]
    with pytest.raises(DviError, match=r"serve.engine='vllm-in-process': expected auto or dvi or vllm-server$"):
        load_config(["serve.engine=vllm-in-process"])


def test_a_trainer_without_the_target_cannot_take_its_teacher_from_the_targets_logits():
    with pytest.raises(DviError, match=r"trainer.features='records'.*trainer.teacher=logits"):
        load_config(["trainer.features=records", "trainer.teacher=logits"])
    cfg = load_config(["trainer.features=records"])
    assert cfg.stream.record_args == {"chunk_rounds": 64, "topk": 8, "features_share": 1.0, "features_max_tokens": 256,
                                      "features_encoding": "int8"}


def test_the_retention_names_the_decision_topic_in_seconds():
    assert load_config([]).stream.retain == ("dvi.decisions", 168 * 3600.0)
    assert load_config(["stream.retention_hours=0.5", "stream.topic=d"]).stream.retain == ("d", 1800.0)
    assert load_config(["stream.retention_hours=null"]).stream.retain is None


def test_conf_dir_is_the_checkouts():
    assert CONF_DIR == Path(__file__).resolve().parents[2] / "conf"


def test_shown_config_masks_every_secret_and_keeps_the_rest():
    from dvi.config import ServeConfig, StreamConfig, shown

    cfg = DviConfig(serve=ServeConfig(api_key="s3cret-key-1"),
                    stream=StreamConfig(security={"sasl_plain_username": "alice", "sasl_plain_password": "pw1",
                                                  "ssl_password": "pw2", "ssl_cafile": "/ca.pem"}))
    out = shown(cfg)
    assert out["serve"]["api_key"] == "***" and not {"s3cret", "pw1", "pw2"} & set(repr(out).replace("'", " ").split())
    assert out["stream"]["security"] == {"sasl_plain_username": "alice", "sasl_plain_password": "***",
                                         "ssl_password": "***", "ssl_cafile": "/ca.pem"}
    assert out["serve"]["port"] == cfg.serve.port and out["serve"]["spec"]["k"] == cfg.serve.spec.k
    assert shown(DviConfig())["serve"]["api_key"] is None
