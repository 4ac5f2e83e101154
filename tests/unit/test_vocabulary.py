"""The shared vocabulary: one settings reader, one error type, one label module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from quart_stage import labels
from quart_stage.errors import QuartError, invalid, unavailable
from quart_stage.settings import ConfigError, settings_from_env


@dataclass(frozen=True)
class _Settings:
    flag: bool = False
    count: int = 3
    rate: float = 1.5
    name: str = "x"
    folder: Path = Path("/tmp")
    sizes: tuple[float, ...] = (1.0,)
    maybe: int | None = None


def test_settings_read_every_type_with_one_rule_set():
    env = {"T_FLAG": "On", "T_COUNT": "7", "T_RATE": "0.25", "T_NAME": "y", "T_FOLDER": "/srv",
           "T_SIZES": "1, 2.5", "T_MAYBE": "4"}
    got = settings_from_env(_Settings, "T_", env)
    assert got == _Settings(True, 7, 0.25, "y", Path("/srv"), (1.0, 2.5), 4)
    assert settings_from_env(_Settings, "T_", {"T_FLAG": "off", "T_COUNT": ""}) == _Settings()


@pytest.mark.parametrize(("var", "raw", "words"), [
    ("T_FLAG", "maybe", "1/true/yes/on"),
    ("T_COUNT", "2.5", "integer"),
    ("T_RATE", "nan", "finite"),
    ("T_RATE", "inf", "finite"),
    ("T_RATE", "fast", "number"),
])
def test_settings_errors_name_the_variable(var, raw, words):
    with pytest.raises(ConfigError, match=words) as info:
        settings_from_env(_Settings, "T_", {var: raw})
    assert var in str(info.value)


def test_overrides_come_last_and_unknown_ones_fail():
    assert settings_from_env(_Settings, "T_", {"T_COUNT": "7"}, count=9, name=None).count == 9
    with pytest.raises(ConfigError, match="nope"):
        settings_from_env(_Settings, "T_", {}, nope=1)
    assert settings_from_env(_Settings, "T_", {"OTHER": "5"}, names={"count": "OTHER"}).count == 5


def test_the_error_type_renders_field_and_retry_after():
    err = invalid("labels.x", "must be an integer")
    assert (err.status, err.to_json()) == (400, {"error": "must be an integer", "field": "labels.x"})
    busy = unavailable(429, "overloaded", 0.2)
    assert busy.headers == {"Retry-After": "1"} and busy.to_json() == {"error": "overloaded"}


def test_labels_parse_and_reject_with_the_label_named():
    got = labels.StageLabels.parse({labels.MODEL: "m", labels.STAGE: "2", labels.STAGES: "4",
                                    labels.SCALE_MAX: "5", labels.PROFILE_MS: "12.5"})
    assert (got.model, got.stage, got.max_replicas, got.profile_ms, got.min_replicas) == ("m", 2, 5, 12.5, 1)
    for bad in ({labels.STAGE: "abc"}, {labels.SCALE_MIN: "-1"}, {labels.PROFILE_MS: "nan"},
                {labels.SCALE_MIN: "3", labels.SCALE_MAX: "2"}, {labels.KEYSMANAGER: "maybe"},
                {labels.STAGE: "4", labels.STAGES: "4"}):
        with pytest.raises(QuartError) as info:
            labels.StageLabels.parse(bad)
        assert info.value.status == 400 and info.value.field.startswith("labels.")


def test_pipelines_skip_malformed_and_broken_models():
    fns = [
        ("a-1", {labels.MODEL: "a", labels.STAGE: "1"}),
        ("a-0", {labels.MODEL: "a", labels.STAGE: "0"}),
        ("b-0", {labels.MODEL: "b", labels.STAGE: "abc"}),  # malformed: not a stage of anything
        ("c-0", {labels.MODEL: "c", labels.STAGE: "0"}),
        ("c-2", {labels.MODEL: "c", labels.STAGE: "2"}),  # hole at 1: not routable
        ("plain", {}),
    ]
    assert labels.pipelines(fns) == {"a": ["a-0", "a-1"]}
